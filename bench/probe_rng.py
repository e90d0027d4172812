"""run_gpu.sh's part (a): on this torch, does a failed CUDA graph capture leave the default generator in
capture mode, and does static_kernels.generator_restore (what StaticEngine._capture calls) take it out? The result
goes into throughput.json's sections.rng_probe (argv[1]); exit 1 when a CUDA random call fails after it."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plumbing import static_kernels  # noqa: E402


def rng_ok(dev: torch.device) -> bool | str:
    try:
        torch.rand(1, device=dev)
        torch.cuda.synchronize(dev)
        return True
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]


out: dict = {"torch": torch.__version__}
if not torch.cuda.is_available():
    out["skipped"] = "no CUDA device"
else:
    dev = torch.device("cuda")
    snap, graph, side, x = (
        static_kernels.generator_snapshot(dev),
        torch.cuda.CUDAGraph(),
        torch.cuda.Stream(),
        torch.ones(4, device=dev),
    )
    try:
        with torch.cuda.stream(side):
            graph.capture_begin()
            try:
                x.sum().item()  # a host sync: not permitted while the stream captures
            finally:
                try:
                    graph.capture_end()
                except Exception as e:
                    out["capture_end_error"] = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:
        out["cause"] = f"{type(e).__name__}: {e}"[:300]
    out["rng_after_failure"] = rng_ok(dev)
    static_kernels.generator_restore(snap)
    out["rng_after_restore"] = rng_ok(dev)
path = Path(sys.argv[1])
report = json.loads(path.read_text()) if path.is_file() else {"sections": {}}
report.setdefault("sections", {})["rng_probe"] = out
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(report, indent=2))
print(json.dumps(out))
sys.exit(0 if out.get("skipped") or out["rng_after_restore"] is True else 1)
