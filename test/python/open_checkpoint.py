"""Opens what write_checkpoint wrote with Python's own readers: safetensors (numpy or torch
flavour) and tensordict's TensorDict.load_memmap. Exits 77 (a skipped test in CTest) with a
message when neither module is installed; any other failure is a failed test."""
import sys

EXPECTED = {
    "params.w": ([[0, 1, 2], [3, 4, 5]], "float32"),
    "params.w_t": ([[0, 3], [1, 4], [2, 5]], "float32"),
    "params.b": ([0.5, 0.5, 0.5], "float16"),
    "opt.m": ([-1.5, 2.25], "float64"),
    "step": (42, "int64"),
    "mask": ([True, False, True], "bool"),
}


def check(name, got, dtype_name, tolist):
    want, want_dtype = EXPECTED[name]
    if dtype_name != want_dtype:
        sys.exit(f"{name}: dtype {dtype_name}, expected {want_dtype}")
    if tolist(got) != want:
        sys.exit(f"{name}: values {tolist(got)}, expected {want}")


def main(directory):
    ran = []
    try:
        import numpy  # noqa: F401
        from safetensors.numpy import load_file

        flat = load_file(f"{directory}/state.safetensors")
        for name in EXPECTED:
            check(name, flat[name], str(flat[name].dtype), lambda a: a.tolist())
        if flat["empty"].shape != (0, 4):
            sys.exit(f"empty: shape {flat['empty'].shape}, expected (0, 4)")
        ran.append("safetensors.numpy.load_file")
    except ImportError as e:
        print(f"safetensors.numpy: not available ({e})")
    try:
        import torch
        from tensordict import TensorDict

        td = TensorDict.load_memmap(f"{directory}/state_td")
        for name in EXPECTED:
            t = td.get(tuple(name.split(".")))
            check(name, t, str(t.dtype).replace("torch.", ""), lambda a: a.tolist())
        if tuple(td.get("empty").shape) != (0, 4):
            sys.exit(f"empty: shape {tuple(td.get('empty').shape)}, expected (0, 4)")
        from safetensors.torch import load_file as load_torch

        flat = TensorDict(load_torch(f"{directory}/state.safetensors")).unflatten_keys(".")
        if not (flat["params", "w"] == torch.arange(6.0).reshape(2, 3)).all():
            sys.exit("safetensors.torch: params.w differs")
        ran.append("tensordict.TensorDict.load_memmap, safetensors.torch.load_file")
    except ImportError as e:
        print(f"tensordict / torch / safetensors.torch: not available ({e})")
    if not ran:
        print("SKIPPED: neither safetensors nor tensordict is installed for", sys.executable)
        sys.exit(77)
    print("opened in Python with:", "; ".join(ran))


if __name__ == "__main__":
    main(sys.argv[1])
