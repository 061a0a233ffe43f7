# Tests of what the benchmarks print and plot, and of what `make bench` builds. Included from the
# benchmarks section of the top-level CMakeLists.txt when tests are built too (needs the td_bench,
# bench_allreduce and bench_backward targets).

# Wording and axis ticks, without MPI.
td_add_serial_test(NAME test_serial_bench_text
                   SOURCES "${CMAKE_CURRENT_LIST_DIR}/test_serial_bench_text.cpp" LABELS bench)
target_link_libraries(test_serial_bench_text PRIVATE td_bench)

# A short bench_allreduce run at 2 ranks: results alone on stdout, progress on stderr, wording,
# and the plot script. A fresh tuning each run (no cache), as a new user's first run.
add_test(NAME bench.output
  COMMAND bash "${CMAKE_CURRENT_LIST_DIR}/check_bench_output.sh" $<TARGET_FILE:bench_allreduce>
          ${TD_MPIEXEC_FLAGS})
set_tests_properties(bench.output PROPERTIES
  LABELS "bench;mpi"
  TIMEOUT 300
  ENVIRONMENT "${_TD_MPI_TEST_ENV};MPIEXEC=${MPIEXEC_EXECUTABLE};TD_AUTOTUNE_CACHE=0")

# `make bench` builds bench_allreduce alone; `make test` builds everything (read with make -n).
add_test(NAME make.bench_targets
  COMMAND bash "${CMAKE_CURRENT_LIST_DIR}/check_make_bench.sh" "${PROJECT_SOURCE_DIR}")
set_tests_properties(make.bench_targets PROPERTIES LABELS "bench;serial" TIMEOUT 60)

# A one-round bench_backward at 2 ranks (its guard compares the Reducer with all_reduce).
add_test(NAME bench.backward
  COMMAND bash "${CMAKE_CURRENT_LIST_DIR}/check_bench_backward.sh" ${MPIEXEC_EXECUTABLE}
          $<TARGET_FILE:bench_backward> ${TD_MPIEXEC_FLAGS})
set_tests_properties(bench.backward PROPERTIES LABELS "bench;mpi" TIMEOUT 120
  ENVIRONMENT "${_TD_MPI_TEST_ENV};TD_AUTOTUNE_CACHE=0")

# A one-round bench_checkpoint at 2 ranks on small dicts (its guard loads back what it saved and
# compares; the default 1 GiB run is for `bench_checkpoint` by hand, docs/checkpoint.md).
add_test(NAME bench.checkpoint
  COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${TD_MPIEXEC_FLAGS}
          $<TARGET_FILE:bench_checkpoint> --rounds 1 --large-bytes 8MiB --small-leaves 256)
set_tests_properties(bench.checkpoint PROPERTIES LABELS "bench;mpi" TIMEOUT 120
  ENVIRONMENT "${_TD_MPI_TEST_ENV}")
