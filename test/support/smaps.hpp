// What the kernel says about the memory mapping that holds an address (Linux /proc/self/smaps):
// for the tests that check storages are advised for transparent huge pages.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace tdtest {

/// The "VmFlags:" line of the mapping that holds `p` in /proc/self/smaps ("" if none).
inline std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

}  // namespace tdtest
