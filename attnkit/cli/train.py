"""``attnkit train TASK``: train one of the applications from scratch, print its evaluation, write its report."""

from __future__ import annotations

import importlib
from pathlib import Path

from ..apps import TASKS
from .command import positive_int

#: Tasks that train one of several models, and those models (the first is the default). Listed here,
#: not read from the task, so that a wrong ``--model`` is answered before torch is imported.
MODELS = {"translate": ("transformer", "rnn")}
#: Tasks that train on one of several sets of pairs, and those sets (the first is the default); listed
#: here for the same reason (``attnkit.apps.translate.PAIRS`` holds the same names).
PAIRS = {"translate": ("fr-de", "dates")}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a small attention model from scratch (" + ", ".join(TASKS) + ")",
        description="Train one application of self-attention from scratch on this machine's CPU (minutes, "
                    "offline, reproducible), print its evaluation as a table, and write the checkpoint "
                    "(model.safetensors + config.json), its pictures (PNG) and report.html into --out.")
    p.add_argument("task", choices=TASKS, help="which application: " + ", ".join(TASKS))
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="training steps (default: the task's own, see attnkit.apps.TASK.DEFAULTS)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="fixes the random initialisation and data order; the same S gives the same "
                        "numbers on one machine (default: 0)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="output folder (default: ./attnkit-TASK/)")
    p.add_argument("--quick", action="store_true", help="tiny sizes that train in seconds (a smoke run)")
    p.add_argument("--model", choices=list(dict.fromkeys(m for ms in MODELS.values() for m in ms)), default=None,
                   help="which model to train, for " + "; ".join(
                       f"{task}: {' or '.join(ms)} (default: {ms[0]})" for task, ms in MODELS.items())
                   + ". translate's rnn is the baseline: a GRU encoder-decoder with additive attention "
                     "(Bahdanau et al. 2015)")
    p.add_argument("--pairs", choices=list(dict.fromkeys(x for xs in PAIRS.values() for x in xs)), default=None,
                   help="which data to train on, for " + "; ".join(
                       f"{task}: {' or '.join(xs)} (default: {xs[0]})" for task, xs in PAIRS.items())
                   + ". translate's fr-de: numbers written in French -> German (num2words' grammars); dates: "
                     "English dates in words -> ISO 8601")
    p.set_defaults(run=run)


def run(args) -> int:
    from .command import UserError, prepare_out

    if args.model is not None and args.model not in MODELS.get(args.task, ()):
        takes = f"its --model is one of {', '.join(MODELS[args.task])}" if args.task in MODELS else "it has no --model"
        raise UserError(f"--model {args.model}: task {args.task!r} cannot train it ({takes})")
    pairs = getattr(args, "pairs", None)
    if pairs is not None and pairs not in PAIRS.get(args.task, ()):
        takes = f"its --pairs is one of {', '.join(PAIRS[args.task])}" if args.task in PAIRS else "it has no --pairs"
        raise UserError(f"--pairs {pairs}: task {args.task!r} cannot train on it ({takes})")
    model = ({} if args.model is None else {"model": args.model}) | ({} if pairs is None else {"pairs": pairs})
    out = args.out if args.out is not None else Path(f"attnkit-{args.task}")
    try:
        task = importlib.import_module(f"attnkit.apps.{args.task}")
    except ModuleNotFoundError as e:
        if e.name == f"attnkit.apps.{args.task}":
            raise UserError(f"task {args.task!r} is not available in this version") from None
        raise UserError(f"the applications need {e.name}: pip install 'attnkit[apps]'") from None
    from ..apps._common import table
    from ..viz.report import Section, write_report

    prepare_out(out)  # an unwritable --out fails here, before minutes of training
    result = task.run(out=out, steps=args.steps, seed=args.seed, quick=args.quick, **model)
    rows = result.evaluation_rows()  # labels with units, as the report shows them
    print(table(rows))
    title = (f"attnkit train {args.task}" + (f" --model {args.model}" if args.model else "")
             + (f" --pairs {pairs}" if pairs else "") + (" --quick" if args.quick else ""))
    summary = Section("Evaluation", f"--seed {args.seed}; {result.seconds:.0f} s in all.", table=rows)
    report = write_report(out / "report.html", title, [summary, *result.sections])
    print(f"checkpoint, pictures and report written to {out}/ (open {report})")
    return 0
