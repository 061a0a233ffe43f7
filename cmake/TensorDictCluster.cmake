# The test suite across hosts: CTest label `cluster`, run by `make test-cluster` (never by plain
# `make test`, which excludes the label). The hosts are network namespaces on this machine made by
# scripts/td-cluster (docs/cluster.md); tests need root.
#
#   cluster.up / cluster.down        the fixture: three hosts td-h1..td-h3 (10.77.0.1-3), made
#                                    once before the first cluster test and removed after the last
#                                    one, also when tests fail
#   cluster.placement.*              mpirun puts the ranks on the hosts we asked for
#   cluster.<mpi test>.3ranks_3hosts, .4ranks_2hosts
#                                    the MPI test executables, TCP only between hosts
#   cluster.example.<name>.<n>ranks  the examples at their largest RANKS count, their EXPECT lines
#   cluster.fault.*                  a host's link taken down, a host's ranks killed, mid-loop
#                                    (test/cluster/fault_across_hosts.sh + cluster_fault_loop);
#                                    link_down_sync.*: ten link cuts under sync collectives
#                                    (test/cluster/link_cut_sync.sh)
#
# Every cluster test holds RESOURCE_LOCK td_cluster: they share the hosts, and the fault tests
# break them on purpose, so they run one at a time whatever `ctest -j` says.

include_guard(GLOBAL)

set(_TD_CLUSTER "${PROJECT_SOURCE_DIR}/scripts/td-cluster")
set(_TD_CLUSTER_HOSTS 3)
set(TD_CLUSTER_TEST_TIMEOUT 300 CACHE STRING "CTest TIMEOUT of a cluster test, in seconds")

# The MPI test environment (yield when idle, oversubscription, sanitizer settings), a tuned-
# bucket-size cache of the cluster's own in the build tree, and a 2-minute default timeout: a
# call that stalls then fails with its diagnosis (where every rank is) in the test's output,
# instead of hanging for the 30-minute default until CTest kills the job without a word.
set(_TD_CLUSTER_ENV ${_TD_MPI_TEST_ENV} "TD_CACHE_DIR=${PROJECT_BINARY_DIR}/cluster-cache"
    "TD_TIMEOUT_MS=120000")

# Every cluster test runs through gate.sh: skipped (77) unless TD_CLUSTER_TESTS=1, which
# `make test-cluster` sets, so a `ctest -R <name>` that matches one of them by accident does not
# touch namespaces.
set(_TD_CLUSTER_GATE bash "${PROJECT_SOURCE_DIR}/test/cluster/gate.sh")

add_test(NAME cluster.up COMMAND ${_TD_CLUSTER_GATE} bash "${_TD_CLUSTER}" up ${_TD_CLUSTER_HOSTS})
add_test(NAME cluster.down COMMAND ${_TD_CLUSTER_GATE} bash "${_TD_CLUSTER}" down)
set_tests_properties(cluster.up PROPERTIES FIXTURES_SETUP td_cluster)
set_tests_properties(cluster.down PROPERTIES FIXTURES_CLEANUP td_cluster)
set_tests_properties(cluster.up cluster.down PROPERTIES
  LABELS cluster TIMEOUT 60 RESOURCE_LOCK td_cluster SKIP_RETURN_CODE 77)

# "td-h1:1,td-h2:1,td-h3:1" for 3 ranks (one per host), "td-h1:2,td-h2:2" for 4 (two per host).
function(_td_cluster_hosts out ranks)
  if(ranks EQUAL 4)
    set(${out} "td-h1:2,td-h2:2" PARENT_SCOPE)
  elseif(ranks GREATER 0 AND ranks LESS_EQUAL ${_TD_CLUSTER_HOSTS})
    set(hosts "")
    foreach(i RANGE 1 ${ranks})
      list(APPEND hosts "td-h${i}:1")
    endforeach()
    list(JOIN hosts "," hosts)
    set(${out} "${hosts}" PARENT_SCOPE)
  else()
    message(FATAL_ERROR "TensorDictCluster: no host layout for ${ranks} ranks")
  endif()
endfunction()

# td-cluster run -- mpirun -np N --host ... [flags] as a list, in `out`. `run` starts mpirun
# inside td-h1 with the launcher agent and TCP-only settings (OMPI_MCA_* in the environment);
# the flags here repeat the transport choice so the command line says what it tests.
function(_td_cluster_mpirun out ranks)
  _td_cluster_hosts(hosts ${ranks})
  set(${out}
    bash "${_TD_CLUSTER}" run -- ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks}
    --host ${hosts} ${TD_MPIEXEC_FLAGS} --mca pml ob1 --mca btl self,tcp
    PARENT_SCOPE)
endfunction()

function(_td_cluster_test name command)
  if(NOT command STREQUAL "COMMAND")
    message(FATAL_ERROR "_td_cluster_test: expected COMMAND")
  endif()
  add_test(NAME ${name} COMMAND ${_TD_CLUSTER_GATE} ${ARGN})
  set_tests_properties(${name} PROPERTIES
    SKIP_RETURN_CODE 77
    LABELS cluster
    TIMEOUT ${TD_CLUSTER_TEST_TIMEOUT}
    FIXTURES_REQUIRED td_cluster
    RESOURCE_LOCK td_cluster
    ENVIRONMENT "${_TD_CLUSTER_ENV}")
endfunction()

# Placement: 3 ranks on 3 hosts and 4 on 2, each host named as asked.
foreach(layout IN ITEMS "3;td-h1 td-h2 td-h3" "4;td-h1 td-h1 td-h2 td-h2")
  list(GET layout 0 ranks)
  list(GET layout 1 expected)
  _td_cluster_mpirun(cmd ${ranks})
  list(JOIN cmd " " cmd_line)
  _td_cluster_test(cluster.placement.${ranks}ranks
    COMMAND bash -c "got=$(${cmd_line} hostname | sort | paste -sd' ') && echo \"hosts: $got\" && [ \"$got\" = '${expected}' ]")
endforeach()

# The MPI tests at 3 ranks on 3 hosts and 4 ranks on 2 hosts.
# test_internal_mpi checks the progress thread's default across hosts (off under Open MPI 4).
foreach(name IN ITEMS test_mpi_collectives test_mpi_tensordict test_mpi_sparse test_mpi_async
                      test_mpi_exchange test_mpi_reducer test_mpi_transport
                      test_mpi_hierarchical test_internal_mpi)
  if(NOT TARGET ${name})
    message(FATAL_ERROR "TensorDictCluster: no target ${name} (a test program of test/)")
  endif()
  foreach(layout IN ITEMS "3;3hosts" "4;2hosts")
    list(GET layout 0 ranks)
    list(GET layout 1 hosts)
    _td_cluster_mpirun(cmd ${ranks})
    set(env_prefix "")
    if(name STREQUAL "test_mpi_hierarchical")
      # Node-aware forced across the real hosts (the other programs run the default, auto: at 4
      # ranks on 2 hosts their first call measures the path).
      set(env_prefix env TD_HIERARCHICAL=1)
    endif()
    _td_cluster_test(cluster.${name}.${ranks}ranks_${hosts}
      COMMAND ${env_prefix} ${cmd} $<TARGET_FILE:${name}>)
  endforeach()
endforeach()

# The examples, at the largest rank count their `// RANKS:` line names (2, 3 or 4), checked
# against their `// EXPECT:` lines by RunAndCompare.cmake, as in td_register_example_tests.
function(_td_cluster_example target source)
  _td_read_example_source("${source}" all_ranks)
  set(ranks 0)
  foreach(n IN LISTS all_ranks)
    if(n GREATER ranks AND n LESS_EQUAL 4)
      set(ranks ${n})
    endif()
  endforeach()
  if(ranks LESS 2)
    return()
  endif()
  set(test_name cluster.example.${target}.${ranks}ranks)
  _td_cluster_mpirun(cmd ${ranks})
  _td_write_example_spec(spec_file ${test_name} ${TD_CLUSTER_TEST_TIMEOUT} ${cmd}
                         $<TARGET_FILE:${target}>)
  _td_cluster_test(${test_name}
    COMMAND ${CMAKE_COMMAND} -DSPEC=${spec_file} -P "${_TD_RUN_AND_COMPARE}")
endfunction()

if(TD_BUILD_EXAMPLES)
  file(GLOB _td_cluster_examples CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/docs/examples/*.cpp")
  foreach(src IN LISTS _td_cluster_examples)
    get_filename_component(name "${src}" NAME_WE)
    _td_cluster_example(${name} "${src}")
  endforeach()
endif()

# Faults across hosts (test/cluster/fault_across_hosts.sh documents the arguments): the
# program's collectives time out after 3 s; the survivors must report within 12 s of a link
# going down, and the job must end within 20 s of a host's ranks being killed.
td_add_test_programs("${PROJECT_SOURCE_DIR}/test/cluster/*.cpp")

set(_td_fault "${PROJECT_SOURCE_DIR}/test/cluster/fault_across_hosts.sh")
foreach(spec IN ITEMS
    "link_down.3ranks_3hosts;link;h3;td-h1:1,td-h2:1,td-h3:1;3;2;3000;12"
    "link_down.4ranks_2hosts;link;h2;td-h1:2,td-h2:2;4;2;3000;12"
    "killed_host.3ranks_3hosts;kill;h2;td-h1:1,td-h2:1,td-h3:1;3;2;3000;20")
  list(POP_FRONT spec test_name)
  _td_cluster_test(cluster.fault.${test_name}
    COMMAND bash "${_td_fault}" ${spec} -- $<TARGET_FILE:cluster_fault_loop>)
  set_tests_properties(cluster.fault.${test_name} PROPERTIES LABELS "cluster;fault")
endforeach()
# (cluster.fault.link_down.4ranks_2hosts ran without the progress thread until 2026-12-01, for a
# stall seen at 4 ranks; it passed 5 of 5 runs with the thread on: docs/cluster.md, known issue.)

# Issue 16 hole 14: a peer lost in the middle of a *sync* collective. Ten fresh jobs of bucketed
# sync all_reduces (2 MiB of leaves reduced in place, so most of a step is the blocking data
# phase; every other job pauses 500 ms between calls, so the cut mostly meets an agreement)
# each lose h3's link at a random moment. The survivors must print the agreement's
# td::TimeoutError verdict or the data-phase watchdog's abort message, and every rank must have
# ended within 15 s of the cut (test/cluster/link_cut_sync.sh). About 10 s per job.
_td_cluster_test(cluster.fault.link_down_sync.3ranks_3hosts.x10
  COMMAND bash "${PROJECT_SOURCE_DIR}/test/cluster/link_cut_sync.sh"
          10 h3 td-h1:1,td-h2:1,td-h3:1 3 2000 500 15 -- $<TARGET_FILE:cluster_fault_loop> --direct)
set_tests_properties(cluster.fault.link_down_sync.3ranks_3hosts.x10 PROPERTIES
  LABELS "cluster;fault" TIMEOUT 300)
