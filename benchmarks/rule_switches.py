"""The question rule's measured-and-not-kept variants, as options shared by the benchmarks
that reproduce them (``choose_default.py``, ``unseen_fillers.py``)."""
import argparse


def add_rule_switches(ap: argparse.ArgumentParser, prompt_probe: bool = False) -> None:
    """``--repeats``, ``--trend`` (and with ``prompt_probe``, ``--prompt-probe``) on ``ap``."""
    if prompt_probe:
        ap.add_argument("--prompt-probe", choices=("paragraph", "tail"), default="paragraph", help="a prompt "
                        "without questions asked apart is probed by the last paragraph of its last tokens "
                        "(paragraph, since 0.8) or by all of them (tail, 0.7)")
    ap.add_argument("--repeats", choices=("last", "scored"), default="last", help="the question rule's sentence "
                    "pieces that repeat an earlier one: kept last (since 0.9) or scored like the rest (0.8)")
    ap.add_argument("--trend", choices=("local", "line", "query"), default="local", help="what the question rule "
                    "takes out of a block's scores: the mean score within 64 positions (the product's), the "
                    "block's least-squares line over its positions (tried in 0.9.1, not kept), or each probe "
                    "query's own mean within 64 positions before the best query is taken (tried in 0.9.2)")
    ap.add_argument("--local", type=int, default=0, help="the positions either side whose mean --trend local or "
                    "query takes out (knorm_gen.question.LOCAL; 0: the product's, 64)")
    ap.add_argument("--carry", type=float, default=None, help="the share of a question_carry layer's rule slots "
                    "kept for the earlier layers' best positions (knorm_gen.question.CARRY_SHARE; default: the "
                    "product's, 0.25); only the question_carry arms read it")


def apply_rule_switches(args: argparse.Namespace) -> None:
    """Set the library's switches as ``args`` (from :func:`add_rule_switches`) ask, before any model work."""
    import functools

    import knorm_gen.cache
    import knorm_gen.question as Q

    tail = getattr(args, "prompt_probe", "paragraph") == "tail"
    if tail or args.repeats == "scored":
        knorm_gen.cache.make_probe = functools.partial(Q.make_probe, paragraph=not tail,
                                                       repeats=args.repeats != "scored")
    if args.trend == "line":
        Q.DETREND, Q.LOCAL = True, 0
    elif args.trend == "query":
        Q.PER_QUERY = True
    if args.local < 0:
        raise SystemExit(f"--local {args.local}: give a number of positions, 1 or more (0: the product's {Q.LOCAL})")
    if args.local and args.trend == "line":
        raise SystemExit(f"--local {args.local} with --trend line: the line takes no local mean; drop --local or "
                         "choose --trend local or query")
    if args.local:
        Q.LOCAL = args.local
    if args.carry is not None:
        if not 0.0 <= args.carry < 1.0:
            raise SystemExit(f"--carry {args.carry}: give a share of the rule's slots, 0 <= F < 1")
        Q.CARRY_SHARE = args.carry
