# Ranks that differ in one input (issue 16), included from the top-level CMakeLists.txt after
# TensorDictTesting.
#
# test_mpi_divergence.<N>ranks: randomized rounds at 2 and 3 ranks (test/test_mpi_divergence.cpp,
# on the harness of test/support/divergence.cpp). Its watchdog ends a hung job after 20 s in one
# phase; the TIMEOUT is the backstop.
td_add_mpi_test(NAME test_mpi_divergence
                SOURCES "${PROJECT_SOURCE_DIR}/test/test_mpi_divergence.cpp"
                        "${PROJECT_SOURCE_DIR}/test/support/divergence.cpp"
                RANKS 2 3 TIMEOUT 240)

# test_mpi_divergence.env.<name>: an MPMD launch (Open MPI syntax) in which rank i runs with the
# environment assignments of the i-th argument ("-" for none; several separated by spaces), e.g.
#   mpiexec -n 1 env TD_SYNC_PIPELINE=1 test_mpi_divergence [divergence_env] : -n 1 ...
# TD_* settings are read once per process, so this is the only way to make ranks differ in one.
function(_td_add_divergence_env_test name)
  set(cmd ${MPIEXEC_EXECUTABLE} ${TD_MPIEXEC_FLAGS})
  set(first TRUE)
  foreach(assignments IN LISTS ARGN)
    if(NOT first)
      list(APPEND cmd ":")
    endif()
    set(first FALSE)
    list(APPEND cmd ${MPIEXEC_NUMPROC_FLAG} 1 ${MPIEXEC_PREFLAGS})
    if(NOT assignments STREQUAL "-")
      separate_arguments(words UNIX_COMMAND "${assignments}")
      list(APPEND cmd env ${words})
    endif()
    list(APPEND cmd $<TARGET_FILE:test_mpi_divergence> ${MPIEXEC_POSTFLAGS} "[divergence_env]")
  endforeach()
  add_test(NAME test_mpi_divergence.env.${name} COMMAND ${cmd})
  set_tests_properties(test_mpi_divergence.env.${name} PROPERTIES
    TIMEOUT 180
    LABELS "mpi"
    ENVIRONMENT "${_TD_MPI_TEST_ENV};${_TD_TEST_MAIN_ENV}")
endfunction()

_td_add_divergence_env_test(sync_pipeline.2ranks "TD_SYNC_PIPELINE=1" "-")
_td_add_divergence_env_test(sync_pipeline.3ranks "-" "TD_SYNC_PIPELINE=1" "-")
_td_add_divergence_env_test(check_layout.2ranks "-" "TD_CHECK_LAYOUT=0")
_td_add_divergence_env_test(check_layout.3ranks "TD_CHECK_LAYOUT=0" "-" "-")
_td_add_divergence_env_test(bucket_bytes.2ranks "TD_BUCKET_BYTES=4096" "-")
_td_add_divergence_env_test(bucket_bytes.3ranks "TD_BUCKET_BYTES=auto" "TD_BUCKET_BYTES=1024" "TD_BUCKET_BYTES=auto")
_td_add_divergence_env_test(progress_thread.2ranks "TD_PROGRESS_THREAD=0" "-")
_td_add_divergence_env_test(progress_thread.3ranks "-" "-" "TD_PROGRESS_THREAD=0")
_td_add_divergence_env_test(timeout_ms.2ranks "-" "TD_TIMEOUT_MS=4000")
_td_add_divergence_env_test(hierarchical.2ranks "TD_HIERARCHICAL=1" "-")
# Rank 1 without a cache directory (HOME, XDG_CACHE_HOME and TD_CACHE_DIR unset) on 2+1 simulated
# nodes: the default measures the path, and every rank must still make the cache key's collective
# call (the results must be correct: no TD_* setting differs).
_td_add_divergence_env_test(no_cache_dir.3ranks "TD_TEST_RANKS_PER_NODE=2"
  "-u HOME -u XDG_CACHE_HOME -u TD_CACHE_DIR TD_TEST_RANKS_PER_NODE=2" "TD_TEST_RANKS_PER_NODE=2")
# On 2+1 simulated nodes the default (auto) may measure node-aware; rank 1 forces flat.
_td_add_divergence_env_test(hierarchical.3ranks "TD_TEST_RANKS_PER_NODE=2" "TD_TEST_RANKS_PER_NODE=2 TD_HIERARCHICAL=0" "TD_TEST_RANKS_PER_NODE=2")
