# Tests of the bucket-size tuner's decisions and of td-autotune. Included from the tools section
# of the top-level CMakeLists.txt when tests are built too.

# The noise rule, the pick and the spot check, as pure functions (src/comm/autotune_model.hpp).
td_add_serial_test(NAME test_serial_autotune_model
                   SOURCES "${CMAKE_CURRENT_LIST_DIR}/test_serial_autotune_model.cpp")
target_include_directories(test_serial_autotune_model PRIVATE "${PROJECT_SOURCE_DIR}/src")

# td-autotune show / clear on a temporary TD_CACHE_DIR, measure and check at 2-3 ranks: the
# autotune line is printed once per job, and a planted, clearly wrong cached cap is measured again.
# It times allreduces and judges the timings (the spot check), so it runs alone (RUN_SERIAL): beside
# another MPI test on 2 cores, every repetition of a pass can wait a time slice for a preempted
# peer, and the sanitizer tree's CI run kept the planted 1 KiB cap three times that way.
add_test(NAME autotune.tool
  COMMAND bash "${CMAKE_CURRENT_LIST_DIR}/check_td_autotune.sh" $<TARGET_FILE:td-autotune>
          ${TD_MPIEXEC_FLAGS})
# Under a sanitizer the planted 1 KiB cap can truly be the cheapest size per byte (the script says
# why); TD_TEST_SANITIZED lets it accept a kept cap whose timings justify it.
if(TD_SANITIZE)
  set(_td_autotune_sanitized 1)
else()
  set(_td_autotune_sanitized 0)
endif()
set_tests_properties(autotune.tool PROPERTIES
  LABELS "mpi"
  TIMEOUT 300
  RUN_SERIAL TRUE
  PROCESSORS 3
  ENVIRONMENT
    "${_TD_MPI_TEST_ENV};MPIEXEC=${MPIEXEC_EXECUTABLE};TD_TEST_SANITIZED=${_td_autotune_sanitized}")
