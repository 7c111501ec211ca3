"""The preflight's command."""

from __future__ import annotations

import json

from cramswarm.cli import arg, command


@command(
    "preflight",
    "rehearse the study on a slice on this device and project the full run; exit 1 when a job will not fit",
    arg("--configfile", nargs="+", required=True, help="the workflow's config files, in order (as --configfile)"),
    arg("--out-dir", required=True, help="folder of report.json and report.md"),
    arg("--results", default="results", help="the results folder whose free disk the outputs need"),
)
def preflight(args) -> int:
    from pathlib import Path

    from cramswarm.config import load_config
    from cramswarm.io import write_json, write_text
    from cramswarm.preflight.run import markdown, preflight

    report = preflight(load_config(args.configfile), Path(args.results))
    out = Path(args.out_dir)
    write_json(out / "report.json", report)
    write_text(out / "report.md", markdown(report))
    for verdict in report["verdicts"]:
        if verdict["verdict"] != "fits":
            print(f"will not fit: {verdict['job']} ({verdict['check']}): {verdict['detail']}")
    print(json.dumps({"fits": report["fits"], "report": str(out / "report.md")}))
    return 0 if report["fits"] else 1
