// Preloaded into MPI tests under LeakSanitizer: Open MPI unloads its components (dlclose) at
// MPI_Finalize, after which their allocations show up as "<unknown module>" and no suppression
// can name them. Keeping every library loaded lets lsan.supp suppress Open MPI's own leaks by
// module while leaks in our code are still reported.
extern "C" int dlclose(void*) { return 0; }
