# Runs a command and checks its output: cmake -DSPEC=<file> -P RunAndCompare.cmake
#
# SPEC is a CMake file (written by td_add_example_test) that sets
#   RUN_COMMAND    the command line, as a list
#   TIMEOUT        seconds before the command is killed (optional)
#   EXPECT_COUNT   number of expected lines, and EXPECT_0 ... EXPECT_<COUNT-1>
# The test fails if the command exits non-zero or if any expected line is not present as a whole
# line of its stdout (order and other lines do not matter; a trailing '\r' is ignored).
# Expected lines are separate variables rather than a list so that brackets and ';' in them
# survive.

cmake_minimum_required(VERSION 3.25)

if(NOT DEFINED SPEC)
  message(FATAL_ERROR "RunAndCompare: pass -DSPEC=<file>")
endif()
include("${SPEC}")
if(NOT RUN_COMMAND)
  message(FATAL_ERROR "RunAndCompare: ${SPEC} sets no RUN_COMMAND")
endif()
if(NOT DEFINED EXPECT_COUNT)
  set(EXPECT_COUNT 0)
endif()
set(timeout_args "")
if(TIMEOUT)
  set(timeout_args TIMEOUT ${TIMEOUT})
endif()

list(JOIN RUN_COMMAND " " command_line)
message(STATUS "Running: ${command_line}")
execute_process(COMMAND ${RUN_COMMAND}
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  RESULT_VARIABLE rc
  ${timeout_args})

# Echo everything so that `ctest --output-on-failure` shows what the program printed.
message("---- stdout ----\n${out}---- stderr ----\n${err}----------------")

if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "RunAndCompare: command failed (exit status: ${rc})")
endif()

string(REPLACE "\r\n" "\n" out "${out}")
set(haystack "\n${out}\n")
set(missing 0)
if(EXPECT_COUNT GREATER 0)
  math(EXPR last "${EXPECT_COUNT} - 1")
  foreach(i RANGE ${last})
    string(FIND "${haystack}" "\n${EXPECT_${i}}\n" pos)
    if(pos EQUAL -1)
      message("RunAndCompare: missing line: \"${EXPECT_${i}}\"")
      math(EXPR missing "${missing} + 1")
    endif()
  endforeach()
endif()
if(missing GREATER 0)
  message(FATAL_ERROR "RunAndCompare: ${missing} of ${EXPECT_COUNT} expected line(s) missing")
endif()
message(STATUS "RunAndCompare: all ${EXPECT_COUNT} expected line(s) present")
