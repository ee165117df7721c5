"""The rope stage: the paper's Figure 1 on a Llama-2-7B-shaped model."""

from __future__ import annotations

import json
import sysconfig

from devtools.gpu_check.runner import Runner, lctrain_cli


def stage_rope(run: Runner, args) -> None:
    from lctrain.shapes import SHAPES, hf_arch  # lctrain is importable once the install stage has run

    r = run.result
    out = run.log.parent / "rope"
    # fp32 has no tensor-core speed: fewer sequences keep the three cases inside one stage
    run.run(
        lctrain_cli()
        + [
            "diagnose",
            "rope",
            "tiny_anchor",
            "--device",
            "cuda",
            "--cases",
            "bf16,random,fp32",
            "--samples",
            str(args.rope_samples),
            "--seq-len",
            "4096",
            "--max-len",
            "8192",
            "--text",
            sysconfig.get_path("stdlib"),
            "--out",
            str(out),
            "--set",
            "model.rope_theta=10000",
            "--set",
            f"model.arch={json.dumps(hf_arch(SHAPES['llama2-7b']))}",
        ]
    )
    res = json.loads((out / "rope_drift.json").read_text())
    shifts = res["shifts"]
    r.columns = [
        "case",
        "D(Δ1=0)",
        f"D(Δ1={shifts[-1]})",
        "first-token share",
        f"D_logit at T={res['logit_lengths'][-1]}",
        "seconds",
    ]
    for case, v in res["cases"].items():
        r.rows.append(
            [case, v["D"][0], v["D"][-1], v["first_token_share"], v["D_logit"][-1], res["timing"][case]["seconds"]]
        )
    r.data = {k: res[k] for k in ("shifts", "delta2", "samples", "seq_len", "timing")}
    r.notes.append(f"{res['samples']} sequences of {res['seq_len']} tokens; figures in {out}")
