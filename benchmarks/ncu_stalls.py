"""Summarise Nsight Compute's per-instruction warp-stall samples (`ncu -i REPORT --page source
--csv --print-source sass > FILE`, from `ncu_target.py`'s profile with --section SourceCounters):
per kernel, the share of samples by stall reason, by SASS opcode, and the hottest instructions.

    python benchmarks/ncu_stalls.py FILE [--top 25]
"""

import argparse
import collections
import csv


def kernels(path):
    """(kernel name, rows of that kernel's table as dicts), in the file's order."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    name, header, table = None, None, []
    for row in rows:
        if row and row[0] == "Kernel Name":
            if name is not None:
                yield name, table
            name, header, table = row[1], None, []
        elif header is None and row and row[0] == "Address":
            header = row
        elif header is not None and len(row) == len(header):
            table.append(dict(zip(header, row)))
    if name is not None:
        yield name, table


def number(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


def summarise(name, table, top):
    reasons = [key for key in table[0] if key.startswith("stall_") and "(Not Issued)" not in key]
    total = sum(number(row["Warp Stall Sampling (All Samples)"]) for row in table) or 1.0
    by_reason = collections.Counter()
    by_opcode = collections.Counter()
    for row in table:
        for reason in reasons:
            by_reason[reason[len("stall_"):]] += number(row[reason])
        opcode = row["Source"].split()[0] if row["Source"].split() else "?"
        if opcode.startswith("@"):
            opcode = row["Source"].split()[1]
        by_opcode[opcode.split(".")[0]] += number(row["Warp Stall Sampling (All Samples)"])
    print(f"== {name}: {int(total)} samples, {len(table)} instructions")
    print("  reasons: " + ", ".join(f"{reason} {100 * count / total:.1f}%"
                                    for reason, count in by_reason.most_common(8)))
    print("  opcodes: " + ", ".join(f"{opcode} {100 * count / total:.1f}%"
                                    for opcode, count in by_opcode.most_common(10)))
    hottest = sorted(enumerate(table), key=lambda item: -number(
        item[1]["Warp Stall Sampling (All Samples)"]))[:top]
    for index, row in sorted(hottest):
        counts = {reason[len("stall_"):]: number(row[reason]) for reason in reasons}
        main = max(counts, key=counts.get)
        share = 100 * number(row["Warp Stall Sampling (All Samples)"]) / total
        print(f"  {index:5d} {share:5.1f}% {main:14s} {row['Source'].strip()[:70]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for name, table in kernels(args.file):
        if table:
            summarise(name, table, args.top)


if __name__ == "__main__":
    main()
