"""The table ``bench/gpu_step`` prints and ``docs/gpu_speed.md`` shows (``bench/docs_tables.py``):
every case of one shape with tokens/s, its ratio to its plain peer, MFU, peak memory and spread,
then the targets of one GPU (nxd_hf against plain HF, peft and Liger) checked on those figures."""

TOKENS_8B_LORA_BF16 = 12_500  # tokens/s at batch 2: NeMo Automodel's published 8B LoRA figure on one H100


def peer_of(name: str) -> str | None:
    """The plain case an nxd_hf case is measured against: the same loop or trainer, LoRA dtype,
    Liger and compile, without nxd_hf (its fused loss is nxd_hf's own); a plain HF case with
    Liger or compile against the bare loop; None for the bare peers themselves."""
    runner, *options = name.split("+")
    if runner.startswith("nxd_"):
        return "+".join(["hf_" + runner.removeprefix("nxd_"), *(o for o in options if o != "fused_loss")])
    if runner == "hf_loop" and options and not any(o.startswith("lora") for o in options):
        return "hf_loop"
    return None


def _ratio(rows: dict, name: str, peer: str | None) -> float | None:
    if peer not in rows or "tokens_per_s" not in rows.get(name, {}) or "tokens_per_s" not in rows[peer]:
        return None
    return rows[name]["tokens_per_s"] / rows[peer]["tokens_per_s"]


def _cell(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    rows = {case["case"]: case for case in report["cases"]}
    lines = ["| case | tokens/s | vs its plain peer | MFU | peak GiB | spread |", "|---|---|---|---|---|---|"]
    for name, case in rows.items():
        if "tokens_per_s" not in case:
            lines.append(f"| {name} | {'skipped' if 'skipped' in case else 'error'}: "
                         f"{case.get('skipped') or case.get('error')} | | | | |")
            continue
        peer = peer_of(name)
        ratio = _ratio(rows, name, peer)
        versus = "—" if ratio is None else f"{ratio:.3f}x {peer}"
        lines.append(f"| {name} | {case['tokens_per_s']:,.0f} | {versus} | {_cell(case.get('mfu'), '.1%')} | "
                     f"{_cell(case.get('peak_gib'), '.1f')} | {case['spread']:.1%} |")
    return "\n".join(lines + ["", *targets(report)])


def targets(report: dict) -> list[str]:
    """One line per target of docs/gpu_speed.md that this shape's cases measure: the figure, the
    bar and whether it is met."""
    rows = {case["case"]: case for case in report["cases"] if "tokens_per_s" in case}
    checks = []

    def ratio(name: str, peer: str, bar: float, what: str) -> None:
        if name in rows and peer in rows:
            value = rows[name]["tokens_per_s"] / rows[peer]["tokens_per_s"]
            checks.append(f"- {what}: {name} / {peer} = {value:.3f} (bar {bar}): {'met' if value >= bar else 'MISSED'}")

    for name, peer in (("nxd_loop", "hf_loop"), ("nxd_trainer", "hf_trainer"),
                       ("nxd_loop+lora_fp32", "hf_loop+lora_fp32"), ("nxd_loop+lora_bf16", "hf_loop+lora_bf16")):
        ratio(name, peer, 1.0, "tp=1 costs nothing")
    ratio("nxd_loop+fused_loss", "nxd_loop", 1.0, "the fused loss is no slower")
    if "nxd_loop+fused_loss" in rows and "nxd_loop" in rows and "peak_gib" in rows["nxd_loop"]:
        value = rows["nxd_loop+fused_loss"]["peak_gib"] / rows["nxd_loop"]["peak_gib"]
        checks.append(f"- the fused loss is leaner: peak nxd_loop+fused_loss / nxd_loop = {value:.3f} (bar 0.7): "
                      f"{'met' if value <= 0.7 else 'MISSED'}")
    nxd = {n: r for n, r in rows.items() if n.startswith("nxd_") and "lora" not in n}
    if nxd:
        best = max(nxd, key=lambda n: nxd[n]["tokens_per_s"])
        ratio(best, "hf_loop+liger", 1.0, f"the best nxd_hf setting ({best}) against one line of Liger")
        ratio(best, "hf_loop", 1.25, f"the best nxd_hf setting ({best}) against plain HF")
    if report.get("shape") == "8b" and "nxd_loop+lora_bf16" in rows:
        value = rows["nxd_loop+lora_bf16"]["tokens_per_s"]
        checks.append(f"- 8B LoRA, bf16 adapters: {value:,.0f} tokens/s (bar {TOKENS_8B_LORA_BF16:,}): "
                      f"{'met' if value >= TOKENS_8B_LORA_BF16 else 'MISSED'}")
    return checks


def heading(report: dict) -> str:
    versions = ", ".join(f"{k} {report[k]}" for k in ("torch", "transformers", "peft", "liger_kernel") if report.get(k))
    return (f"*Measured {report['date']} on {report['gpu']} ({versions}); shape {report['shape']}, batch "
            f"{report['batch']} x seq {report['seq']}, {report['warmup']} warm-up + {report['steps']} timed steps.*")
