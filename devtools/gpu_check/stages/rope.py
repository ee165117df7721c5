"""The rope stages: the paper's Figure 1 on a Llama-2-7B-shaped random model (`rope`), and Figures 1 and 7 on real
pretrained weights (`rope_real`: SmolLM2-135M, the example model, at the paper's 4096 tokens).

`rope_real`'s time, estimated (not yet measured): the `rope` stage measured ~15 s of probe per 4096-token sequence
and case on Llama-2-7B's 1024 layer-heads; SmolLM2 has 270, so ~4 s for Figure 1's sweep and as much again for
Figure 7's Δ2 sweep, ~8 s per sequence and case: 20 sequences x 3 cases fit the 570-s stage, the paper's 50 do not."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from devtools.gpu_check.runner import Runner, lctrain_cli

# The paper's Figure 1 setting: 50 sequences of 4096 tokens, logit lengths up to 8192, its 19 shifts (the default).
REAL_SEQ_LEN = 4096
REAL_MAX_LEN = 8192


def stage_rope(run: Runner, args) -> None:
    from lctrain.shapes import SHAPES, hf_arch  # lctrain is importable once the install stage has run

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
    report_drift(run, out)


def real_weights_commands(work: Path, samples: int) -> list[list[str]]:
    """The commands of `rope_real`: the example model and the standard library's code as text (the prose topics have
    too few documents of 8192 tokens), then the diagnostic in the paper's three cases with Figure 7's Δ2 sweep."""
    model, text = work / "smollm2", work / "code.jsonl"
    return [
        lctrain_cli() + ["example-model", str(model)],
        lctrain_cli() + ["example-text", str(text), "--kinds", "code"],
        lctrain_cli()
        + ["diagnose", "rope", str(model), "--device", "cuda", "--text", str(text), "--samples", str(samples)]
        + ["--seq-len", str(REAL_SEQ_LEN), "--max-len", str(REAL_MAX_LEN), "--vary-delta2", "--shift-batch", "20"]
        + ["--out", str(work)],
    ]


def stage_rope_real(run: Runner, args) -> None:
    out = run.log.parent / "rope_real"
    for cmd in real_weights_commands(out, args.rope_real_samples):
        run.run(cmd)
    report_drift(run, out)
    run.result.targets.extend(paper_claims(json.loads((out / "rope_drift.json").read_text())))


def report_drift(run: Runner, out: Path) -> None:
    """One row per case of `out`/rope_drift.json: D at Δ1 = 0 and at the largest shift, the first token's share of
    D(0), D_logit at the longest length, and the time."""
    r = run.result
    res = json.loads((out / "rope_drift.json").read_text())
    shifts = res["shifts"]
    r.columns = [
        "case",
        "D(Δ1=0)",
        f"D(Δ1={shifts[-1]})",
        "first-token share",
        "first token / others",
        f"D_logit at T={res['logit_lengths'][-1]}",
        "seconds",
    ]
    for case, v in res["cases"].items():
        at_zero = v["D"][shifts.index(0)] if 0 in shifts else None
        r.rows.append(
            [
                case,
                at_zero,
                v["D"][-1],
                v["first_token_share"],
                v["first_token_vs_others"],
                v["D_logit"][-1],
                res["timing"][case]["seconds"],
            ]
        )
    r.data = {k: res[k] for k in ("shifts", "delta2", "samples", "seq_len", "timing")}
    r.notes.append(f"{res['samples']} sequences of {res['seq_len']} tokens; figures in {out}")


def paper_claims(res: dict) -> list[dict]:
    """The paper's Figure 1 findings (§2.2) as checks on a rope_drift.json with the fp32, bf16 and random cases and
    Δ1 = 0 among the shifts: each {"name", "value", "goal", "met"}, reported, not required."""
    c, shifts = res["cases"], res["shifts"]
    zero = shifts.index(0)
    bf16, fp32, random = c["bf16"], c["fp32"], c["random"]
    far = max(range(len(shifts)), key=lambda i: shifts[i])

    def ratio(a, b):
        return a / b if b > 0 else float("inf")

    checks = [
        ("bf16 D / fp32 D at Δ1=0 (bf16 breaks RoPE, fp32 keeps it)", ratio(bf16["D"][zero], fp32["D"][zero]), 100),
        ("bf16 D / random-init D at Δ1=0 (pretraining amplifies)", ratio(bf16["D"][zero], random["D"][zero]), 1),
        (
            f"bf16 D(Δ1={shifts[far]}) / D(Δ1=0) (grows with the shift)",
            ratio(bf16["D"][far], bf16["D"][zero]),
            1,
        ),
        (
            "bf16 first token / mean other token in D(0) (the first token contributes most)",
            bf16["first_token_vs_others"],
            1,
        ),
        (
            f"bf16 D_logit(T={res['logit_lengths'][-1]}) / D_logit(T={res['logit_lengths'][0]}) (grows with length)",
            ratio(bf16["D_logit"][-1], bf16["D_logit"][0]),
            1,
        ),
    ]
    return [dict(name=n, value=round(v, 3), goal=f"> {g}", met=v > g) for n, v, g in checks]
