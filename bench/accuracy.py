"""Reduced-precision accuracy on the device: Kiln fp16 / bf16 ResNet-50 top-1 agreement with fp32 (torch) on
fixed random-but-seeded inputs, and BERT-base fp16 max abs error on the hidden states.

    python -m bench.accuracy [--images 1000] [--batch 100] [--out bench/results]

Prints a table and writes JSON. The fp32 reference is the torch module itself (TF32 off).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.engine import write_results

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--precisions", default="fp16,bf16")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.engine import build_kiln, export_onnx, kiln_runner, set_torch_precision, single_output, torch_model

    set_torch_precision("fp32")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in ("resnet50", "bert_base"):
            module, names, make_inputs = torch_model(name)
            wrapped = single_output(module)
            path = export_onnx(wrapped, names, make_inputs(2), Path(work) / f"{name}.onnx")
            batch = args.batch if name == "resnet50" else 16
            count = args.images if name == "resnet50" else 64
            for precision in args.precisions.split(","):
                engine, _, _ = build_kiln(path, names, precision, [1, batch, batch], make_inputs(1))
                agree, total, worst = 0, 0, 0.0
                for start in range(0, count, batch):
                    generator = torch.Generator(device="cuda").manual_seed(1000 + start)
                    if name == "resnet50":
                        inputs = (torch.randn(batch, 3, 224, 224, device="cuda", generator=generator),)
                    else:
                        ids = torch.randint(0, 30522, (batch, 128), device="cuda", generator=generator)
                        inputs = (ids, torch.ones_like(ids), torch.zeros_like(ids))
                    run, y, _ = kiln_runner(engine, names, inputs)
                    run()
                    with torch.no_grad():
                        ref = wrapped(*inputs).float()
                    torch.cuda.synchronize()
                    worst = max(worst, float((y.float() - ref).abs().max()))
                    if name == "resnet50":
                        agree += int((y.float().argmax(-1) == ref.argmax(-1)).sum())
                    total += batch
                row = {"model": name, "precision": precision, "inputs": total, "max_abs_error": worst,
                       "top1_agreement_with_fp32": agree / total if name == "resnet50" else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'model':<10}{'prec':>6}{'inputs':>8}{'top-1 agree':>13}{'max |err|':>12}")
    for r in rows:
        agree = f"{r['top1_agreement_with_fp32']:.4f}" if r["top1_agreement_with_fp32"] is not None else "-"
        print(f"{r['model']:<10}{r['precision']:>6}{r['inputs']:>8}{agree:>13}{r['max_abs_error']:>12.4g}")
    write_results(args.out, "accuracy", {"device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
