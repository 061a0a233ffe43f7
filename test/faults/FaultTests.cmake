# The fault tests (label `fault`), included from the top-level CMakeLists.txt when
# TD_BUILD_FAULT_TESTS is on (the sanitizer trees, which skip the label, leave it off and build
# none of these programs).
# Fault injection: programs that time out, throw, or die on purpose. Each runs under mpiexec
# through test/faults/expect_outcome.sh, which fails on a hang (its own time limit), on the
# wrong exit status, or when the expected message is missing.
td_add_test_programs("${PROJECT_SOURCE_DIR}/test/faults/fault_*.cpp")
function(td_add_fault_test name ranks seconds regex)
  add_test(NAME fault.${name}.${ranks}ranks
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" ${seconds} nonzero "${regex}" --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:fault_${name}>)
  set_tests_properties(fault.${name}.${ranks}ranks PROPERTIES LABELS "fault;mpi" TIMEOUT 120
    ENVIRONMENT "OMPI_MCA_mpi_yield_when_idle=1;TD_AUTOTUNE_CACHE=0")
endfunction()
td_add_fault_test(timeout 2 30 "timeout test: ok")
td_add_fault_test(timeout 3 30 "timeout test: ok")
td_add_fault_test(extra_finish 2 30 "extra finish: ok")
td_add_fault_test(uncaught 2 30 "rank 1.*boom on rank 1")
td_add_fault_test(killed_rank 3 60 "killing myself")
td_add_fault_test(data_phase_stall 2 40 "TimeoutError: TensorDict.all_reduce.*watchdog ends the job")
# The diagnosis of a timeout (issue 29): test/faults/fault_diagnosis.cpp, one situation per
# run, at 2, 3 and 4 ranks; rank 0 prints the verdict of every rank's checks. With td-flight,
# the same run again with TD_FLIGHT_RECORDER_DIR, its dumps read back: each scenario's own
# lines of td-flight's verdict, and its number of dumps (test/faults/flight_analyzer.sh).
set(td_fault_env
    "OMPI_MCA_mpi_yield_when_idle=1;TD_AUTOTUNE_CACHE=0;OMPI_MCA_orte_allowed_exit_without_sync=1")
foreach(scenario IN ITEMS sleep no_call other_collective other_call other_group exited
                          silent_async extra_step raw_mpi)
  foreach(ranks IN ITEMS 2 3 4)
    set(run ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:fault_diagnosis> ${scenario})
    add_test(NAME fault.diagnosis.${scenario}.${ranks}ranks
      COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 60 nonzero
              "rank 0: diagnosis ${scenario}: ok" -- ${run})
    set_tests_properties(fault.diagnosis.${scenario}.${ranks}ranks PROPERTIES
      LABELS "fault;mpi" TIMEOUT 120 ENVIRONMENT "${td_fault_env}")
    if(TD_BUILD_TOOLS)
      add_test(NAME flight.analyzer.${scenario}.${ranks}ranks
        COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/flight_analyzer.sh" ${scenario} ${ranks}
                $<TARGET_FILE:td-flight> -- ${run})
      set_tests_properties(flight.analyzer.${scenario}.${ranks}ranks PROPERTIES
        LABELS "fault;mpi" TIMEOUT 120 ENVIRONMENT "${td_fault_env}")
    endif()
  endforeach()
endforeach()
# The flight recorder's dumps (issue 29), one way of writing them per test, at 2 ranks:
# test/faults/fault_dumps.cpp runs it, then checks the files it left and the run's output.
target_link_libraries(fault_dumps PRIVATE nlohmann_json::nlohmann_json)
foreach(how IN ITEMS sigusr1 abort uncaught watchdog explicit explicit_own)
  set(exit_kind nonzero)
  if(how STREQUAL "sigusr1")
    set(exit_kind zero)
  endif()
  add_test(NAME flight.dumps.${how}
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/flight_dumps.sh" ${how} ${exit_kind}
            $<TARGET_FILE:fault_dumps> --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:fault_dumps> run ${how})
  set_tests_properties(flight.dumps.${how} PROPERTIES LABELS "fault;mpi" TIMEOUT 120
    ENVIRONMENT "${td_fault_env}")
endforeach()
# The test main's reports of a rank that leaves early or fails alone (issue 32): a hidden test
# case of test/faults/main_exits.cpp per way out, at 2 ranks, and the line the output must hold.
_td_add_test_executable(test_main_exits mpi "${PROJECT_SOURCE_DIR}/test/faults/main_exits.cpp")
function(td_add_test_main_test tag regex)
  add_test(NAME fault.test_main.${tag}.2ranks
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 30 nonzero "${regex}" --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:test_main_exits> "[${tag}]")
  set_tests_properties(fault.test_main.${tag}.2ranks PROPERTIES LABELS "fault;mpi" TIMEOUT 120
    ENVIRONMENT "${_TD_MPI_TEST_ENV};${_TD_TEST_MAIN_ENV}")
endfunction()
td_add_test_main_test(exit
  "rank 1\\] exit\\(\\) or quick_exit\\(\\) was called during test case 'rank 1 calls exit")
td_add_test_main_test(signal
  "rank 1\\] killed by SIGSEGV \\(signal 11\\) during test case 'rank 1 dies of SIGSEGV")
td_add_test_main_test(fail
  "every rank finished its tests: 0 passed \\(1 assertion\\), 1 FAILED \\(1 of 1 assertion, 1 test case\\)")
# A TD_* variable whose value its rule rejects stops init_process_group on every rank with an
# error naming the variable and the value (core/config.cpp reads every TD_* under one rule),
# never a silent default: one variable of each kind (boolean, count, choice, list, log level).
foreach(setting "TD_AUTOTUNE_REFRESH=maybe" "TD_TIMEOUT_MS=-5" "TD_HIERARCHICAL=2"
                "TD_TEST_RANKS_PER_NODE=2,x" "TD_LOG_LEVEL=loud")
  string(REGEX REPLACE "=.*" "" var "${setting}")
  add_test(NAME fault.bad_setting.${var}.2ranks
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 30 nonzero
            "${var}=[^ ]*: expected" --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:test_main_exits> "[pass]")
  set_tests_properties(fault.bad_setting.${var}.2ranks PROPERTIES LABELS "fault;mpi"
    TIMEOUT 60 ENVIRONMENT "${_TD_MPI_TEST_ENV};${_TD_TEST_MAIN_ENV};${setting}")
endforeach()
# A rank's finalize going wrong, by test/faults/finalize_faults.cpp preloaded into the ranks of
# test_main_exits [pass]. Not under the sanitizers, whose runtimes need LD_PRELOAD themselves.
if(NOT TD_SANITIZE)
  add_library(td_finalize_faults SHARED "${PROJECT_SOURCE_DIR}/test/faults/finalize_faults.cpp")
  target_link_libraries(td_finalize_faults PRIVATE MPI::MPI_C ${CMAKE_DL_LIBS} td_warnings)
  target_compile_definitions(td_finalize_faults PRIVATE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
  function(td_add_finalize_fault_test name exit_kind regex shim_env)
    set(cmd ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${TD_MPIEXEC_FLAGS}
            -x LD_PRELOAD=$<TARGET_FILE:td_finalize_faults>)
    foreach(assignment IN LISTS shim_env)
      list(APPEND cmd -x ${assignment})
    endforeach()
    list(APPEND cmd ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_main_exits> ${MPIEXEC_POSTFLAGS} "[pass]")
    add_test(NAME fault.test_main.${name}.2ranks
      COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 120 ${exit_kind} "${regex}"
              -- bash -c "for run in 1 2 3; do \"\$@\" || exit; done" ${name} ${cmd})
    set_tests_properties(fault.test_main.${name}.2ranks PROPERTIES LABELS "fault;mpi"
      TIMEOUT 180 ENVIRONMENT "${_TD_MPI_TEST_ENV};${_TD_TEST_MAIN_ENV}")
  endfunction()
  # mpiexec stopped for 3 s as rank 1 finalizes: every rank passed and finalized, so the job
  # must pass. Three runs, because whether mpiexec then misreports a rank as having exited
  # improperly is a race (10 of 15 runs without _TD_TEST_MAIN_ENV).
  td_add_finalize_fault_test(slow_mpiexec zero "rank 1\\] destroy_process_group took"
                             "TD_STALL_RANK=1;TD_STALL_MS=3000")
  # Rank 1's MPI_Finalize returns an error: said, and the job fails (the first run ends the loop).
  td_add_finalize_fault_test(finalize_fails nonzero
                             "rank 1\\] destroy_process_group threw: MPI_Finalize failed"
                             "TD_FAIL_FINALIZE_RANK=1")
endif()
# A rank killed during a parallel save: the previous checkpoint stays intact, and nothing else
# appears under its name (at 3 ranks an uneven split, at 4 more ranks than cores).
foreach(format IN ITEMS safetensors memmap)
  foreach(ranks IN ITEMS 2 3 4)
    if(format STREQUAL "safetensors")
      set(name fault.checkpoint_killed.${ranks}ranks)  # the name the 2-rank test always had
    else()
      set(name fault.checkpoint_killed.${format}.${ranks}ranks)
    endif()
    add_test(NAME ${name}
      COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/checkpoint_killed.sh"
              "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" ${ranks} ${format}
              ${MPIEXEC_EXECUTABLE} ${TD_MPIEXEC_FLAGS} -- $<TARGET_FILE:fault_checkpoint_killed>)
    set_tests_properties(${name} PROPERTIES LABELS "fault;mpi" TIMEOUT 120
      PASS_REGULAR_EXPRESSION "previous checkpoint intact" PROCESSORS ${ranks}
      ENVIRONMENT "OMPI_MCA_mpi_yield_when_idle=1;TD_AUTOTUNE_CACHE=0")
  endforeach()
endforeach()
# Not faults, but whole-program runs (destroy_process_group ends MPI): exit 0 expected.
function(td_add_destroy_test ranks suffix env)
  add_test(NAME fault.destroy_pending${suffix}.${ranks}ranks
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 40 zero
            "destroy with pending works: ok" --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:fault_destroy_pending>)
  set_tests_properties(fault.destroy_pending${suffix}.${ranks}ranks PROPERTIES
    LABELS "fault;mpi" TIMEOUT 120 ENVIRONMENT "OMPI_MCA_mpi_yield_when_idle=1;${env}")
endfunction()
td_add_destroy_test(1 "" "TD_PROGRESS_THREAD=1")
td_add_destroy_test(3 "" "TD_PROGRESS_THREAD=1")
td_add_destroy_test(2 ".no_progress_thread" "TD_PROGRESS_THREAD=0")
# Dropped async Works: completed by their destructor, and said once per process (exit 0).
foreach(ranks 1 3)
  add_test(NAME fault.dropped_work.${ranks}ranks
    COMMAND bash "${PROJECT_SOURCE_DIR}/test/faults/expect_outcome.sh" 40 zero
            "dropped works: ok" --
            ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${TD_MPIEXEC_FLAGS}
            $<TARGET_FILE:fault_dropped_work>)
  set_tests_properties(fault.dropped_work.${ranks}ranks PROPERTIES
    LABELS "fault;mpi" TIMEOUT 120 ENVIRONMENT "OMPI_MCA_mpi_yield_when_idle=1")
endforeach()
