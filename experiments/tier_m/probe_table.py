"""The probe's table: per engine precision, the mean over the probe's steps of the engine/trainer
mismatch of the responses each step trained on (log pi_old recomputed by the trainer with the
weights that sampled them: the synchronous loop's mismatch alone) and of the routing agreement.
    python3 experiments/tier_m/probe_table.py experiments/tier_m/probe
"""

import json
import sys
from pathlib import Path

METRICS = (("mismatch_abs_logp_diff_mean", "mean |log pi_old - log mu|"), ("mismatch_kl_k3", "KL(mu||pi_old), k3"),
           ("routing_agreement", "routing agreement"))


def main(folder: str) -> None:
    rows = []
    for engine in ("fp32", "bf16", "fp8"):
        path = Path(folder) / f"runs_{engine}.jsonl"
        records = [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]
        means = [sum(r[m] for r in records) / len(records) for m, _ in METRICS]
        rows.append((engine, len(records), means))
    print("| engine | steps | " + " | ".join(label for _, label in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for engine, steps, means in rows:
        print(f"| {engine} | {steps} | " + " | ".join(f"{m:.4g}" for m in means) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
