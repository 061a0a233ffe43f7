// Symbol visibility: the library is built with -fvisibility=hidden; only what is marked TD_API
// is part of the ABI of libtensordict.so.
#pragma once

#if defined(_WIN32)
#if defined(TD_BUILDING_LIBRARY)
#define TD_API __declspec(dllexport)
#else
#define TD_API __declspec(dllimport)
#endif
#else
#define TD_API __attribute__((visibility("default")))
#endif
