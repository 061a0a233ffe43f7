// Process groups for MPI tests.
#pragma once

#include <vector>

#include <tensordict/tensordict.hpp>

/// A new group of every world rank (collective over world): its own communicator, caches and
/// sequence numbers, whatever earlier test cases did on world.
inline td::ProcessGroup fresh_group() {
  std::vector<int> all;
  for (int r = 0; r < td::get_world_size(); ++r) all.push_back(r);
  return td::new_group(all);
}
