"""Two builds of the native kernels alternating in one process, on a bench model's own weights.

    python -m benchmarks.kernel_ab --base HEAD~1 --variant full --rounds 12

`benchmarks.ab` compares whole engines and still wanders 5–10% run to run here; a change inside one
kernel is judged more sharply by loading the revision's kernel library beside the working tree's and
calling both, alternately, on the same inputs and the same packed weights. Measured: the vocabulary
projection (`clover_panel_gemm`) on 1 row (decode) and 32 rows (a block step), the L3 flushed before
each call so the weights stream from memory as in a real step, and the four MoE blocks of a 32-token
block step at `block_expert_top_p` 0.7 (`clover_moe_block`, where both builds have it). It also says
whether the two builds' outputs are bit-identical. Both builds must share the panel layout (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import checkpoints
from benchmarks.ab import import_revision


def _moe_args(moe, x, h, top_p, out, distinct):
    """`clover_moe_block`'s arguments for a whole-block step of `x` (kernels/moe_block.py's)."""
    from clover.kernels.moe_block import moe_block_args

    B, T, H = x.shape
    return moe_block_args(moe, B, T, H, T, top_p.data_ptr(), x.data_ptr(), h.data_ptr(), out.data_ptr(),
                          distinct.data_ptr(), torch.get_num_threads())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels to compare the working tree's against")
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)

    import importlib

    import clover
    from clover.runtime import flush_denormals

    current_build = importlib.import_module("clover.kernels.build")
    current_panels = importlib.import_module("clover.kernels.panels")

    flush_denormals(True)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_revision(args.base, Path(tmp))
        base_build = importlib.import_module("clover_base.kernels.build")
        base_panels = importlib.import_module("clover_base.kernels.panels")
        if base_panels.PANEL != current_panels.PANEL:
            sys.exit(f"{args.base} packs panels of {base_panels.PANEL} columns, the working tree {current_panels.PANEL}")
        libs = {f"base ({args.base})": base_build.library(), "working tree": current_build.library()}
        if not all(libs.values()):
            sys.exit("the kernels do not build here")
        del base

        model = clover.load(checkpoints.ensure_checkpoint(args.variant), dtype=torch.bfloat16, pack=True)
        head = model.lm_head.packed
        N, K = head.out_features, head.in_features
        flush = torch.empty(300 * 2**20 // 4)               # larger than this machine's share of L3
        g = torch.Generator().manual_seed(0)
        H = model.config.hidden_size
        xs = [torch.nn.functional.rms_norm(torch.randn(1, 32, H, generator=g), (H,)).bfloat16() for _ in range(4)]
        h, top_p = torch.randn(1, 32, H, generator=g).bfloat16(), torch.tensor([0.7])
        moe_ok = all(hasattr(lib, "clover_moe_block") for lib in libs.values())
        times: dict = {}
        outputs: dict = {}
        with torch.inference_mode():
            for rnd in range(args.rounds):
                for name in (list(libs) if rnd % 2 else list(libs)[::-1]):
                    lib = libs[name]
                    for rows in (1, 32):
                        x = xs[rnd % 4][0, :rows].contiguous()
                        out = torch.empty(rows, N, dtype=torch.bfloat16)
                        flush.fill_(rnd)
                        t = time.perf_counter()
                        lib.clover_panel_gemm(x.data_ptr(), K, 1, rows, K, head.panels.data_ptr(), N, out.data_ptr(), N,
                                              0, torch.get_num_threads())
                        times.setdefault((f"vocabulary projection, {rows} row(s) (ms)", name), []).append(time.perf_counter() - t)
                        outputs[(rows, name)] = out
                    if moe_ok:
                        outs = [torch.empty_like(h) for _ in model.model.layers]
                        distinct = torch.empty(1, dtype=torch.int64)
                        t = time.perf_counter()
                        for i, layer in enumerate(model.model.layers):
                            lib.clover_moe_block(*_moe_args(layer.mlp, xs[(rnd + i) % 4], h, top_p, outs[i], distinct))
                        times.setdefault(("MoE blocks of a block step, 4 layers (ms)", name), []).append(time.perf_counter() - t)
                        outputs[("moe", name)] = torch.stack(outs)

        names = list(libs)
        print(f"{args.variant}, {torch.get_num_threads()} threads, median of {args.rounds} alternating rounds")
        print(f"{'':48s}{names[0]:>22s}{names[1]:>22s}   change")
        for op in dict.fromkeys(k[0] for k in times):
            a, b = (statistics.median(times[(op, n)]) * 1e3 for n in names)
            print(f"{op:48s}{a:22.2f}{b:22.2f}   {100 * (b / a - 1):+.1f}%")
        same = all(torch.equal(outputs[(key, names[0])], outputs[(key, names[1])])
                   for key in {k for k, _ in outputs})
        print("outputs bit-identical between the builds:", same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
