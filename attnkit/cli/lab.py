"""``attnkit lab``: run the experiments of :mod:`attnkit.lab`, print their verdicts, write a report."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    from ..lab import EXPERIMENTS

    p = sub.add_parser(
        "lab", help="test what tutorials claim about attention: a number, a plot and a verdict per claim",
        description="Run small experiments that test claims commonly made about self-attention (scaling by "
                    "sqrt(d_k), projections, shared Q/K, score functions, cost, recurrent and convolutional "
                    "layers, positions, W_O, heads, "
                    "initialisation), print a verdict table (supported / refuted / depends) and write "
                    "report.html with every figure and plot into --out.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"experiments to run (default: all): {', '.join(EXPERIMENTS)}")
    p.add_argument("--out", type=Path, default=Path("attnkit-lab"),
                   help="folder for report.html and the PNGs (default: ./attnkit-lab/); an existing one must be "
                        "yours and not writable by others")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer training steps (seconds each)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..lab import EXPERIMENTS, check_names
    from .command import UserError, prepare_out

    if args.list:
        width = max(map(len, EXPERIMENTS))
        for name, (_, title) in EXPERIMENTS.items():
            print(f"{name:<{width}}  {title}")
        return 0
    try:
        names = check_names(args.names)
    except ValueError as e:
        raise UserError(str(e)) from None
    prepare_out(args.out)  # the default ./attnkit-lab, run from /tmp, may have been made by someone else
    from ..lab import run_one, verdict_table, write_report

    findings = []
    for name in names:
        print(f"{name} ...", end=" ", flush=True)
        findings.append(run_one(name, quick=args.quick, out=args.out))
        print(f"{findings[-1].verdict} ({findings[-1].seconds:.1f} s)", flush=True)
    print()
    rows = verdict_table(findings)
    width = max(len(r["experiment"]) for r in rows)
    for r in rows:
        print(f"{r['experiment']:<{width}}  {r['verdict']:<9}  {r['why']}")
    report = write_report(findings, args.out, quick=args.quick)
    print(f"\nWrote {report} ({sum(r['seconds'] for r in rows):.1f} s in all).")
    return 0


