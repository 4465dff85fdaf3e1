"""`sparrow schedule list | show NAME_OR_FILE | budget NAME_OR_FILE --length L`."""

import json

from sparrow.schedule import load_schedule, published_schedules
from sparrow.tables import format_table


def configure(p) -> None:
    cmds = p.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)

    lst = cmds.add_parser("list", help="published schedule names")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(handler=run_list)

    show = cmds.add_parser("show", help="table per bin: length range, blocks, tokens")
    show.add_argument("schedule", metavar="NAME_OR_FILE")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=run_show)

    budget = cmds.add_parser("budget", help="blocks and tokens attended at a total length")
    budget.add_argument("schedule", metavar="NAME_OR_FILE")
    budget.add_argument("--length", type=int, required=True, help="total length L = prompt + generated tokens")
    budget.add_argument("--json", action="store_true")
    budget.set_defaults(handler=run_budget)


def run_list(args) -> int:
    tables = published_schedules()
    if args.json:
        print(json.dumps(sorted(tables)))
        return 0
    rows = [[name, f"{s.blocks_for_bin(0) * s.block_size}", f"{s.blocks_for_bin(s.num_bins - 1) * s.block_size}"] for name, s in tables.items()]
    print(format_table(["name", "first-bin tokens", "last-bin tokens"], rows))
    return 0


def run_show(args) -> int:
    s = load_schedule(args.schedule)
    bins = []
    for i in range(s.num_bins):
        lo, hi = s.bin_range(i)
        blocks = s.blocks_for_bin(i)
        bins.append({"bin": i, "min_length": lo, "max_length": hi, "topk_blocks": s.topk_blocks[i], "blocks": blocks,
                     "tokens": None if blocks is None else blocks * s.block_size})
    if args.json:
        print(json.dumps({"schedule": s.to_dict(), "bins": bins}))
        return 0
    print(f"schedule {s.name} (version {s.version}): block {s.block_size} tokens, sink {s.sink}, recent {s.recent}")
    rows = [[b["bin"], s.bin_text(b["bin"]), "dense" if b["blocks"] is None else b["blocks"],
             "dense" if b["tokens"] is None else b["tokens"]] for b in bins]
    print(format_table(["bin", "total length (tokens)", "blocks", "KV tokens"], rows))
    print("attention is dense while the context fits in the budget, and always in the dense layers and in prefill")
    return 0


def run_budget(args) -> int:
    s = load_schedule(args.schedule)
    if args.length < 1:
        raise ValueError(f"--length={args.length}: must be >= 1 token")
    blocks = s.blocks_attended(args.length)
    info = {
        "schedule": s.name, "length": args.length, "bin": s.bin_of(args.length),
        "context_blocks": -(-args.length // s.block_size), "dense": blocks is None,
        "blocks": blocks, "tokens": None if blocks is None else blocks * s.block_size,
    }
    if args.json:
        print(json.dumps(info))
    elif blocks is None:
        print(f"{s.name} at L={args.length} (bin {info['bin']}): dense ({info['context_blocks']} blocks fit in the budget)")
    else:
        print(f"{s.name} at L={args.length} (bin {info['bin']}): {blocks} blocks = {blocks * s.block_size} KV tokens "
              f"of {info['context_blocks']} blocks")
    return 0
