# Test registration helpers for tensordict-mpi.
#
#   td_add_serial_test(NAME n SOURCES a.cpp... [TIMEOUT s] [LABELS l...])
#       One executable, run directly as test `n` (label serial). No MPI_Init in its main.
#   td_add_mpi_test(NAME n SOURCES a.cpp... [RANKS 1 2 3 4] [TIMEOUT s] [LABELS l...])
#       One executable, registered once per rank count as `n.<N>ranks` under mpiexec (label mpi).
#       Its main initialises the process group, silences ranks other than 0 unless they fail,
#       agrees on the exit code across ranks and checks that every rank finalized (so mpiexec is
#       told not to, see _TD_TEST_MAIN_ENV). An odd rank count catches power-of-two assumptions;
#       the TIMEOUT turns a deadlock into a failure instead of a hung CI job.
#   td_add_example_test(NAME n [TARGET t] COMMAND_RANKS N EXPECT "line"... [TIMEOUT s])
#       Runs executable target t (default: n) under mpiexec at N ranks as test
#       `example.n.<N>ranks` and fails unless it exits 0 and every EXPECT line appears as a whole
#       line of its stdout (cmake/RunAndCompare.cmake). EXPECT lines may contain unbalanced
#       brackets (multi-line tensor prints); they may not contain ';'.
#   td_register_example_tests(TARGET t SOURCE file.cpp)
#       Reads `// RANKS: N [M...]` and `// EXPECT: text` comment lines from an example's source
#       and calls td_add_example_test for each rank count. Text after "// EXPECT: " is taken
#       verbatim, leading spaces included. No RANKS line: no test.

include_guard(GLOBAL)

set(TD_MPIEXEC_FLAGS "--oversubscribe;--allow-run-as-root" CACHE STRING
    "Flags given to mpiexec before the rank count's program (Open MPI spelling)")
set(TD_TEST_TIMEOUT 120 CACHE STRING "Default CTest TIMEOUT of a test, in seconds")

set(_TD_RUN_AND_COMPARE "${CMAKE_CURRENT_LIST_DIR}/RunAndCompare.cmake")
set(_TD_TEST_MAIN "${PROJECT_SOURCE_DIR}/test/main.cpp")

if(NOT MPIEXEC_EXECUTABLE)
  message(FATAL_ERROR "TensorDictTesting: mpiexec not found (MPIEXEC_EXECUTABLE is empty)")
endif()

# Environment of every test. Oversubscription and yielding keep 4 ranks on 2 cores from
# busy-polling each other into timeouts.
set(_TD_TEST_ENV "")
set(_TD_MPI_TEST_ENV
  "OMPI_MCA_rmaps_base_oversubscribe=1"
  "OMPI_MCA_mpi_yield_when_idle=1")
if(TD_SANITIZE)
  # Open MPI unloads its components (dlclose) at MPI_Finalize; their allocations then show up as
  # "<unknown module>" (LeakSanitizer cannot suppress them by name) and ThreadSanitizer aborts on
  # unloading a library named in a suppression. Keeping every library loaded avoids both.
  if(NOT TARGET td_no_dlclose)
    add_library(td_no_dlclose SHARED "${PROJECT_SOURCE_DIR}/test/sanitizers/no_dlclose.cpp")
    # Not instrumented: it is also preloaded into mpiexec, which must not start a sanitizer.
    target_compile_options(td_no_dlclose PRIVATE -fno-sanitize=all)
    target_link_options(td_no_dlclose PRIVATE -fno-sanitize=all)
  endif()
  list(APPEND _TD_TEST_ENV "LD_PRELOAD=$<TARGET_FILE:td_no_dlclose>")
endif()
if("address" IN_LIST TD_SANITIZE)
  # Open MPI's own allocations are reported as leaks; lsan.supp names its libraries, not ours.
  list(APPEND _TD_TEST_ENV "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:verify_asan_link_order=0"
    "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/test/sanitizers/lsan.supp:print_suppressions=0")
endif()
if("undefined" IN_LIST TD_SANITIZE)
  list(APPEND _TD_TEST_ENV "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
endif()
if("thread" IN_LIST TD_SANITIZE)
  # history_size=7: the other side of a reported race must keep its stack, or a write that Open
  # MPI's progress made into a caller's buffer on another thread (invisible synchronisation, see
  # tsan.supp) shows "failed to restore the stack" and no suppression can match it.
  list(APPEND _TD_TEST_ENV "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:history_size=7:suppressions=${PROJECT_SOURCE_DIR}/test/sanitizers/tsan.supp")
endif()
list(PREPEND _TD_MPI_TEST_ENV ${_TD_TEST_ENV})
# Added for programs whose main is test/main.cpp: mpiexec does not require a rank's finalize
# handshake (issue 32). Open MPI's PMIx client waits at most 2 s for mpiexec to acknowledge a
# rank's MPI_Finalize and then lets the rank exit; a mpiexec that did not get to run within those
# 2 s (a loaded machine) may see the exit first, and end the job saying that a rank which passed
# and finalized "exited improperly". The test main makes the same check itself, without the race:
# every rank's result is gathered before anyone finalizes, MPI must be finalized when main
# returns, and exit() before that ends the job with td::abort.
set(_TD_TEST_MAIN_ENV "OMPI_MCA_orte_allowed_exit_without_sync=1")

# Catch2's implementation is compiled once (test/catch_impl.cpp), at -O1: under the sanitizers,
# optimising its 17,000 lines took minutes per copy, and its speed does not matter to a test.
# The test main is compiled twice: with TD_TEST_MPI (initialises the process group, agrees on
# the exit code) for MPI tests and without it for serial tests (which need no MPI and no
# library: the white-box tests link the library's objects instead).
if(NOT TARGET td_catch_impl)
  add_library(td_catch_impl OBJECT "${PROJECT_SOURCE_DIR}/test/catch_impl.cpp")
  target_link_libraries(td_catch_impl PUBLIC Catch2::Catch2)
  target_compile_options(td_catch_impl PRIVATE -O1)
endif()
foreach(_td_kind IN ITEMS serial mpi)
  if(NOT TARGET td_test_main_${_td_kind})
    add_library(td_test_main_${_td_kind} OBJECT "${_TD_TEST_MAIN}")
    target_link_libraries(td_test_main_${_td_kind} PUBLIC Catch2::Catch2 td_warnings)
  endif()
endforeach()
target_compile_definitions(td_test_main_mpi PRIVATE TD_TEST_MPI)
target_link_libraries(td_test_main_mpi PUBLIC TensorDict::tensordict)

# A program per source file matching the file(GLOB) `pattern`, named after the file and linked to
# the library, with its own main: the fault-injection and cross-host test programs.
function(td_add_test_programs pattern)
  file(GLOB sources CONFIGURE_DEPENDS "${pattern}")
  foreach(src IN LISTS sources)
    get_filename_component(name "${src}" NAME_WE)
    add_executable(${name} "${src}")
    target_link_libraries(${name} PRIVATE TensorDict::tensordict td_warnings)
  endforeach()
endfunction()

function(_td_add_test_executable name kind)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE td_test_main_${kind} td_catch_impl TensorDict::tensordict
                                        Catch2::Catch2 td_warnings)
  if(kind STREQUAL "mpi")
    target_compile_definitions(${name} PRIVATE TD_TEST_MPI)
  endif()
endfunction()

function(td_add_serial_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;TIMEOUT" "SOURCES;LABELS")
  if(NOT arg_NAME OR NOT arg_SOURCES)
    message(FATAL_ERROR "td_add_serial_test: NAME and SOURCES are required")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT ${TD_TEST_TIMEOUT})
  endif()
  _td_add_test_executable(${arg_NAME} serial ${arg_SOURCES})
  add_test(NAME ${arg_NAME} COMMAND ${arg_NAME})
  set_tests_properties(${arg_NAME} PROPERTIES
    TIMEOUT ${arg_TIMEOUT}
    LABELS "serial;${arg_LABELS}")
  if(_TD_TEST_ENV)
    set_tests_properties(${arg_NAME} PROPERTIES ENVIRONMENT "${_TD_TEST_ENV}")
  endif()
endfunction()

# mpiexec -n N <flags> [prefix flags] <program> [post flags] as a list, in `out`.
function(_td_mpiexec_command out ranks program)
  set(${out}
    ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${TD_MPIEXEC_FLAGS}
    ${MPIEXEC_PREFLAGS} ${program} ${MPIEXEC_POSTFLAGS}
    PARENT_SCOPE)
endfunction()

# Registers runs of an existing MPI test program (one whose main is test/main.cpp: the runs get
# _TD_TEST_MAIN_ENV): <NAME>.<n>ranks for each of RANKS (default 1 2 3 4), with ENVIRONMENT added
# to the MPI test environment and ARGS passed to the program.
function(td_add_mpi_test_runs)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;TARGET;TIMEOUT" "RANKS;LABELS;ENVIRONMENT;ARGS")
  if(NOT arg_NAME OR NOT arg_TARGET)
    message(FATAL_ERROR "td_add_mpi_test_runs: NAME and TARGET are required")
  endif()
  if(NOT arg_RANKS)
    set(arg_RANKS 1 2 3 4)
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT ${TD_TEST_TIMEOUT})
  endif()
  # Under ThreadSanitizer the races it looks for are between a process's own threads (the caller
  # and the progress thread), which 2 ranks exercise as well as 3 and 4: a run of 2 or 3 ranks
  # becomes one run at 2 (a 3-rank test then runs at 2 with the same settings), 4 ranks only is
  # not registered (its simulated node layouts need 4), 1 rank stays. Instrumented runs at 3 ranks
  # on this project's 2-core CI host took 5-10x as long as alone when ctest ran two at once: the
  # waiting ranks' polling starved the rank still checking its results, and four of them passed
  # the 300 s limit without any deadlock (their stacks, read with gdb, were all still moving).
  # Each MPI test also takes one ctest slot per rank (PROCESSORS), so two instrumented jobs never
  # share the cores. Plain builds run every count; ASan, below, all but 4 where 3 runs too.
  if("thread" IN_LIST TD_SANITIZE)
    set(td_tsan_ranks "")
    if(2 IN_LIST arg_RANKS OR 3 IN_LIST arg_RANKS)
      list(APPEND td_tsan_ranks 2)
    endif()
    if(1 IN_LIST arg_RANKS)
      list(APPEND td_tsan_ranks 1)
    endif()
    if(NOT td_tsan_ranks)
      return()
    endif()
    set(arg_RANKS ${td_tsan_ranks})
  elseif("address" IN_LIST TD_SANITIZE AND 3 IN_LIST arg_RANKS)
    # Under AddressSanitizer the memory a rank touches follows from its share of each bucket and
    # split: 2 ranks (even) and 3 (uneven, not a power of two) cover what 4 adds, and the 4-rank
    # runs were a third of the ASan suite's time (149 of 447 s, 2026-12-03). A test registered at
    # 4 ranks only (a simulated node layout that needs 4) still runs.
    list(REMOVE_ITEM arg_RANKS 4)
  endif()
  foreach(n IN LISTS arg_RANKS)
    _td_mpiexec_command(cmd ${n} $<TARGET_FILE:${arg_TARGET}>)
    add_test(NAME ${arg_NAME}.${n}ranks COMMAND ${cmd} ${arg_ARGS})
    set_tests_properties(${arg_NAME}.${n}ranks PROPERTIES
      TIMEOUT ${arg_TIMEOUT}
      LABELS "mpi;${arg_LABELS}"
      ENVIRONMENT "${_TD_MPI_TEST_ENV};${_TD_TEST_MAIN_ENV};${arg_ENVIRONMENT}")
    if("thread" IN_LIST TD_SANITIZE)
      set_tests_properties(${arg_NAME}.${n}ranks PROPERTIES PROCESSORS ${n})
    endif()
  endforeach()
endfunction()

function(td_add_mpi_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;TIMEOUT" "SOURCES;RANKS;LABELS")
  if(NOT arg_NAME OR NOT arg_SOURCES)
    message(FATAL_ERROR "td_add_mpi_test: NAME and SOURCES are required")
  endif()
  _td_add_test_executable(${arg_NAME} mpi ${arg_SOURCES})
  td_add_mpi_test_runs(NAME ${arg_NAME} TARGET ${arg_NAME} RANKS ${arg_RANKS}
                       TIMEOUT ${arg_TIMEOUT} LABELS ${arg_LABELS})
endfunction()

# Writes the spec RunAndCompare.cmake reads for `test_name`: the command (ARGN), its time limit,
# and the expected lines, which come from the caller's variables _td_expect_count and
# _td_expect_<i> rather than a list, because CMake lists do not survive unbalanced '[' (as in
# "tensor([[1., 2.],"). Sets `out` to the spec file (one per configuration).
function(_td_write_example_spec out test_name timeout)
  set(spec "# Generated for ${test_name}\nset(RUN_COMMAND")
  foreach(word IN LISTS ARGN)
    string(APPEND spec " [==[${word}]==]")
  endforeach()
  string(APPEND spec ")\nset(TIMEOUT ${timeout})\nset(EXPECT_COUNT ${_td_expect_count})\n")
  if(_td_expect_count GREATER 0)
    math(EXPR last "${_td_expect_count} - 1")
    foreach(i RANGE ${last})
      if(_td_expect_${i} MATCHES "]==]")
        message(FATAL_ERROR "${test_name}: an EXPECT line may not contain ']==]'")
      endif()
      string(APPEND spec "set(EXPECT_${i} [==[${_td_expect_${i}}]==])\n")
    endforeach()
  endif()
  set(spec_file "${PROJECT_BINARY_DIR}/example_tests/${test_name}-$<CONFIG>.cmake")
  file(GENERATE OUTPUT "${spec_file}" CONTENT "${spec}")
  set(${out} "${spec_file}" PARENT_SCOPE)
endfunction()

# Registers example.<name>.<ranks>ranks: the example under mpiexec, its output compared with the
# expected lines (see _td_write_example_spec).
function(_td_add_example_test_impl name target ranks timeout)
  set(test_name example.${name}.${ranks}ranks)
  _td_mpiexec_command(cmd ${ranks} $<TARGET_FILE:${target}>)
  _td_write_example_spec(spec_file ${test_name} ${timeout} ${cmd})
  add_test(NAME ${test_name}
    COMMAND ${CMAKE_COMMAND} -DSPEC=${spec_file} -P "${_TD_RUN_AND_COMPARE}")
  math(EXPR outer_timeout "${timeout} + 10")
  set_tests_properties(${test_name} PROPERTIES
    TIMEOUT ${outer_timeout}
    LABELS "example;mpi"
    ENVIRONMENT "${_TD_MPI_TEST_ENV}")
endfunction()

function(td_add_example_test)
  # Arguments are read one by one through ARGV<i>, never as a list (see above).
  set(name "")
  set(target "")
  set(ranks "")
  set(timeout ${TD_TEST_TIMEOUT})
  set(_td_expect_count 0)
  set(mode "")
  math(EXPR last "${ARGC} - 1")
  foreach(i RANGE ${last})
    set(a "${ARGV${i}}")
    if(a STREQUAL "NAME" OR a STREQUAL "TARGET" OR a STREQUAL "COMMAND_RANKS"
       OR a STREQUAL "TIMEOUT" OR a STREQUAL "EXPECT")
      set(mode "${a}")
    elseif(mode STREQUAL "NAME")
      set(name "${a}")
    elseif(mode STREQUAL "TARGET")
      set(target "${a}")
    elseif(mode STREQUAL "COMMAND_RANKS")
      set(ranks "${a}")
    elseif(mode STREQUAL "TIMEOUT")
      set(timeout "${a}")
    elseif(mode STREQUAL "EXPECT")
      set(_td_expect_${_td_expect_count} "${a}")
      math(EXPR _td_expect_count "${_td_expect_count} + 1")
    else()
      message(FATAL_ERROR "td_add_example_test: unexpected argument '${a}'")
    endif()
  endforeach()
  if(name STREQUAL "" OR ranks STREQUAL "")
    message(FATAL_ERROR "td_add_example_test: NAME and COMMAND_RANKS are required")
  endif()
  if(target STREQUAL "")
    set(target "${name}")
  endif()
  _td_add_example_test_impl("${name}" "${target}" "${ranks}" "${timeout}")
endfunction()

# Reads an example's `// RANKS: N [M...]` and `// EXPECT: text` lines: sets <ranks_var> to the
# rank counts and, in the caller's scope, _td_expect_count and _td_expect_0.. to the expected
# lines (the one space after the colon removed). Shared with TensorDictCluster.cmake.
function(_td_read_example_source source ranks_var)
  file(READ "${source}" text)
  string(REPLACE "\r\n" "\n" text "${text}")
  set(ranks "")
  set(count 0)
  # Walk the lines with string operations only: list splitting would mangle brackets and ';'.
  while(NOT text STREQUAL "")
    string(FIND "${text}" "\n" eol)
    if(eol EQUAL -1)
      set(line "${text}")
      set(text "")
    else()
      string(SUBSTRING "${text}" 0 ${eol} line)
      math(EXPR next "${eol} + 1")
      string(SUBSTRING "${text}" ${next} -1 text)
    endif()
    if(line MATCHES "^// RANKS:(.*)$")
      string(STRIP "${CMAKE_MATCH_1}" r)
      separate_arguments(r UNIX_COMMAND "${r}")
      list(APPEND ranks ${r})
    elseif(line MATCHES "^// EXPECT:")
      string(LENGTH "// EXPECT:" prefix_len)
      string(SUBSTRING "${line}" ${prefix_len} -1 expected)
      if(expected MATCHES "^ ")  # the one space after the colon is not part of the line
        string(SUBSTRING "${expected}" 1 -1 expected)
      endif()
      set(_td_expect_${count} "${expected}" PARENT_SCOPE)
      math(EXPR count "${count} + 1")
    endif()
  endwhile()
  set(_td_expect_count ${count} PARENT_SCOPE)
  set(${ranks_var} "${ranks}" PARENT_SCOPE)
endfunction()

function(td_register_example_tests)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "TARGET;SOURCE" "")
  _td_read_example_source("${arg_SOURCE}" ranks)
  foreach(n IN LISTS ranks)
    _td_add_example_test_impl("${arg_TARGET}" "${arg_TARGET}" "${n}" "${TD_TEST_TIMEOUT}")
  endforeach()
endfunction()
