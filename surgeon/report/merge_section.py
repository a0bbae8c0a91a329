"""The model card's account of a merge: each source with its fingerprint, and the merge written as
the mergekit config it corresponds to (what mergekit users look for in a card)."""

from __future__ import annotations

import yaml


def merge_section(entry: dict) -> list[str]:
    details = entry["details"]
    lines = [
        "## Merge",
        "",
        f"Method **{entry['params']['method']}**, merged tensor by tensor in {details['seconds']:.1f} s "
        f"(peak resident memory of the run so far {details['peak_rss_bytes'] / 2**20:,.0f} MiB).",
        "",
        "| source | checkpoint | fingerprint |",
        "|---|---|---|",
    ]
    for name, source in details["sources"].items():
        lines.append(f"| {name} | {source['label']} | `{source['fingerprint']}` |")
    config = yaml.safe_dump(details["mergekit"], sort_keys=False).strip()
    return lines + ["", "As a mergekit config:", "", "```yaml", config, "```", ""]
