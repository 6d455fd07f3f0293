"""How far an honest stage and its checker differ, per kind and per path: the figures behind the spot checks'
tolerances (swarm.leader.serving.verify.TOLERANCES).

    .venv/bin/python bench/verify_bounds.py                       # the full 10,000 checks on a tiny model
    .venv/bin/python bench/verify_bounds.py --model builtin --checks 1000

A ring of 3 stages in this process serves made-up greedy requests through the fellow's batch path (prompt chunks,
single and batched decode steps, drafting's verifying passes) and a second copy of each stage recomputes every pass
as a checker does (tests/honest_checks.py); each pair is compared with the leader's function. It prints, per kind and
path, the checks run and the largest difference (hidden states: relative to the output's largest value; last stage:
the claimed token's logit below the greedy one, relative to the largest logit, 0 when the tokens agree), and how many
the product's tolerance would flag (it must be 0). tests/test_verify.py runs the same at a smaller count in CI.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from honest_checks import KINDS, honest_checks, requests_for  # noqa: E402
from swarm.leader.serving.verify import tolerance  # noqa: E402


def model_dir(which: str, tmp: Path) -> Path:
    from swarm.store.importer import import_model

    if which == "builtin":
        import_model("smollm2-135m-instruct", tmp / "models")
        return tmp / "models" / "smollm2-135m-instruct"
    from conftest import build_tiny_source

    import_model(str(build_tiny_source(tmp / "src", which)), tmp / "models", which)
    return tmp / "models" / which


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", help="a tiny family of tests/conftest.py, or 'builtin'")
    parser.add_argument("--checks", type=int, default=10_000,
                        help="checks of the pairs the leader judges, shared by the kinds (the cross-kernel pair "
                             "gets as many more)")
    parser.add_argument("--kinds", default=",".join(KINDS) + ",int4-fast/torch",
                        help="comma-separated; int4-fast/torch: a checker without swarm's int4 kernel")
    args = parser.parse_args()
    import torch

    variants = [(kind.split("/")[0], not kind.endswith("/torch")) for kind in args.kinds.split(",")]
    per_variant = args.checks // max(1, sum(kernel for _, kernel in variants))  # --checks: of the pairs judged
    flagged = total = 0
    bad_note = ""
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_dir(args.model, Path(tmp))
        for kind, kernel in variants:
            began = time.perf_counter()
            checks = honest_checks(folder, kind, requests_for(per_variant), checker_kernel=kernel)
            quantization = KINDS[kind][1]
            tol = tolerance(quantization, kind == "bfloat16", False)
            worst: dict[tuple[int, str], tuple[int, float]] = {}
            for c in checks:
                n, largest = worst.get((c.stage, c.path), (0, 0.0))
                worst[(c.stage, c.path)] = (n + 1, max(largest, c.difference))
            bad = sum(c.difference > tol for c in checks)
            if kernel:
                flagged += bad
            else:  # measured, not judged: the leader never pairs fellows on different 4-bit kernels
                bad_note = " (such pairs are not judged: swarm.leader.serving.verify)"
            total += len(checks) if kernel else 0
            name = checks[0].kind if checks else kind
            note = "" if kernel else bad_note
            print(f"{name}: {len(checks)} checks in {time.perf_counter() - began:.0f} s, largest "
                  f"{max(c.difference for c in checks):.2e}, tolerance {tol:g}, flagged {bad}{note}", flush=True)
            for (stage, path), (n, largest) in sorted(worst.items()):
                print(f"    stage {stage} {path:15s} {n:5d} checks, largest {largest:.2e}")
    print(f"{total} checks of pairs the leader judges, {flagged} flagged")
    print(f"model: {args.model}; machine: {platform.processor() or platform.machine()}, {platform.system()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
