"""The supported-architecture table of ``docs/architectures.md`` from
``bench/results/architectures.json`` (written by ``python -m bench.architectures``), between the
marker comments; the only source of that table. ``python -m bench.docs_tables`` writes it."""

BEGIN, END = "<!-- architectures-table:begin -->", "<!-- architectures-table:end -->"
COLUMNS = {"tp2": "tp=2", "tp2_sp": "tp=2 SP", "tp4": "tp=4", "tp4_sp": "tp=4 SP", "pp2": "pp=2",
           "tp2_pp2": "tp=2 pp=2", "ep2": "ep=2", "tp2_ep2": "tp=2 ep=2", "tp2_fused": "tp=2 fused loss"}
MARK = {"pass": "yes", "refused": "refused", "wrong": "**WRONG**", "crash": "**CRASH**", "hang": "**HANG**"}


def _reason(message: str) -> str:
    """The construct a refusal names, short enough for a table cell."""
    message = message.split("(every rank stops here): ")[-1].removeprefix("ValueError: ") if message else ""
    first = message.split(". ")[0] if message else ""
    if first.startswith("'"):  # "'layers.*.mlp.experts': a mixture-of-experts layer ..."
        first = first.split(": ", 1)[-1]
    first = first.split(" (HF tensor-parallel style")[0].split(" (TraceError")[0]
    return first.replace("|", "/")[:100]


def table(payload: dict) -> str:
    layouts = [name for name in COLUMNS if any(name in cases for cases in payload["results"].values())]
    lines = [f"Measured with transformers {payload['transformers']} (tiny configs, loss and every gradient "
             "against the unparallelized model, fp32, rtol 1e-4, atol 1e-5).", "",
             "| model type | " + " | ".join(COLUMNS[n] for n in layouts) + " | note |",
             "|---" * (len(layouts) + 2) + "|"]
    for model_type, cases in payload["results"].items():
        cells = [MARK.get(cases[n]["status"], cases[n]["status"]) if n in cases else "" for n in layouts]
        failing = next((cases[n] for n in layouts if n in cases and cases[n]["status"] != "pass"), None)
        note = _reason(failing["message"]) if failing else ""
        lines.append(f"| {model_type} | " + " | ".join(cells) + f" | {note} |")
    counts = {}
    for cases in payload["results"].values():
        for name in layouts:
            if name in cases:
                counts.setdefault(name, {}).setdefault(cases[name]["status"], 0)
                counts[name][cases[name]["status"]] += 1
    lines += ["", "Totals: " + "; ".join(
        f"{COLUMNS[n]}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts[n].items())) for n in layouts) + "."]
    return "\n".join(lines)
