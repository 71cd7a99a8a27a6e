"""The targets and the table of ``bench/optimizer/run.py``."""


def check_targets(cases: list[dict]) -> dict:
    """ZeRO-1 state = 1/dp (+-1%) at every dp; step time <= both peers' at dp 2."""
    out = {}
    for case in cases:
        if case["method"] == "nxd_zero1" and "skipped" not in case:
            out[f"state_1_over_dp_dp{case['dp']}"] = abs(case["state_fraction"] * case["dp"] - 1) <= 0.01
    timed = {c["method"]: c["step_seconds"] for c in cases if c["dp"] == 2 and "skipped" not in c}
    for peer in ("torch_zero_redundancy", "deepspeed_zero1"):
        if peer in timed and "nxd_zero1" in timed:
            out[f"step_time_le_{peer}_dp2"] = timed["nxd_zero1"] <= timed[peer]
    return out


def format_table(result: dict) -> str:
    lines = ["| dp | method | state MB/rank | state / unsharded | peak MB/rank | step ms | final loss |",
             "|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        dp = f"{c['dp']}{' (oversubscribed)' if c['oversubscribed'] else ''}"
        if "skipped" in c:
            lines.append(f"| {dp} | {c['method']} | skipped: {c['skipped'][:120]} |  |  |  |  |")
            continue
        lines.append(f"| {dp} | {c['method']} | {c['state_bytes_per_rank'] / 2**20:.1f} | "
                     f"{c['state_fraction']:.4f} | {c['peak_bytes_per_rank'] / 2**20:.0f} | "
                     f"{c['step_seconds'] * 1e3:.0f} | {c['final_loss']:.5f} |")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in result["targets"].items()))
    return "\n".join(lines)
