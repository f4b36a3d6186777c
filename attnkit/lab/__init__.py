"""``attnkit lab``: claims that tutorials make about attention, each tested by a small experiment.

Every experiment is a module here with ``run(quick: bool, out: Path) -> Finding``: it measures,
draws its pictures into ``out`` and gives a verdict (``supported``, ``refuted`` or ``depends``)
with one sentence of why. :data:`EXPERIMENTS` lists them in order; importing this package does not
import torch (the command line checks its arguments first), each experiment does.

Usage::

    from attnkit import lab
    finding = lab.run_one("scaling", quick=True, out=Path("lab-out"))
    print(finding.verdict, finding.figures["frac_saturated_unscaled_4096"])
    print(finding.labels["frac_saturated_unscaled_4096"])  # what the report calls that figure
"""

from .runner import EXPERIMENTS, VERDICTS, Finding, check_names, run_one, verdict_table, write_report

__all__ = ["EXPERIMENTS", "VERDICTS", "Finding", "check_names", "run_one", "verdict_table", "write_report"]
