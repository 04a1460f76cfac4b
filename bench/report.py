"""Turning measured rows into the best point per router, ratios against the peers, and a printed table."""

from __future__ import annotations

import math

BASELINES = ("mini_lb", "sgl-router", "pd-router-base")  # the last only with --baseline-checkout
DIRECT = "direct"
REQUIRED_RPS_VS_MINI_LB = 3.0  # issue 3: at least 3x mini_lb's requests/s, with a lower p99


def _key(row: dict) -> tuple[str, int]:
    return row["mode"], row["concurrency"]


def best_rows(rows: list[dict]) -> list[dict]:
    """One row per (router, mode, concurrency): the round with the most requests/s (least disturbed by
    the machine's other users), plus its latency added over the direct baseline of the same point."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["router"], *_key(row))
        if key not in best or row["rps"] > best[key]["rps"]:
            best[key] = row
    out = []
    for (router, mode, concurrency), row in best.items():
        row = dict(row)
        direct = best.get((DIRECT, mode, concurrency))
        if direct is not None and router != DIRECT:
            for field in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
                if row.get(field) is not None and direct.get(field) is not None:
                    row[f"added_{field}"] = round(row[field] - direct[field], 3)
        out.append(row)
    return out


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def ratios(best: list[dict], variants: tuple[str, ...] = ()) -> list[dict]:
    """For every router and point: requests/s, p99 and CPU per request, each as router / baseline. A variant
    (pd-router with flags of its own, `--variant`) is also compared with plain pd-router."""
    by_key = {(row["router"], *_key(row)): row for row in best}
    out = []
    for row in best:
        if row["router"] == DIRECT:
            continue
        for baseline in BASELINES + (("pd-router",) if row["router"] in variants else ()):
            base = by_key.get((baseline, *_key(row)))
            if base is None or baseline == row["router"]:
                continue
            out.append({
                "router": row["router"], "vs": baseline, "mode": row["mode"], "concurrency": row["concurrency"],
                "rps": _ratio(row["rps"], base["rps"]),
                "p50": _ratio(row["p50_ms"], base["p50_ms"]),
                "p99": _ratio(row["p99_ms"], base["p99_ms"]),
                "cpu_per_req": _ratio(row.get("router_cpu_ms_per_req"), base.get("router_cpu_ms_per_req")),
            })
    return out


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    if not values:
        return None
    return round(math.exp(sum(math.log(v) for v in values) / len(values)), 3)


def _fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def progress_line(row: dict) -> str:
    ttft = f" ttft p50/p99 {_fmt(row.get('ttft_p50_ms'))}/{_fmt(row.get('ttft_p99_ms'))} ms" \
        if row.get("ttft_p50_ms") is not None else ""
    return (f"  {row['router']:<12} {row['mode']:<10} c={row['concurrency']:<4} {row['rps']:8.0f} req/s  "
            f"p50 {_fmt(row['p50_ms'])} p99 {_fmt(row['p99_ms'])} ms{ttft}  errors {row['errors']}  "
            f"router {_fmt(row.get('router_cpu_ms_per_req'), '.3f')} cpu-ms/req  "
            f"others {row['foreign_cores']:.2f} cores  load {row['load1_at_start']:.2f}")


def render(result: dict) -> str:
    env = result["environment"]
    lines = [
        "",
        f"== {result['setup']} setup: {env['cores']} cores, {env['cpu']}; load average before "
        f"{', '.join(f'{x:.2f}' for x in env['load_avg_before'])}, after "
        f"{', '.join(f'{x:.2f}' for x in env['load_avg_after'])}; sglang-router {env['sglang_router']}; "
        f"policy {result['policy'] or 'each router default'}",
    ]
    best = sorted(result["best"], key=lambda r: (r["mode"], r["concurrency"], r["router"] != DIRECT, r["router"]))
    header = (f"{'mode':<10} {'conc':>4} {'router':<12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'+p50':>7} {'+p99':>7} {'ttft50':>7} {'ttft99':>7} {'errors':>6} {'cpu-ms/req':>10} {'others':>6}")
    lines += [header, "-" * len(header)]
    for row in best:
        lines.append(
            f"{row['mode']:<10} {row['concurrency']:>4} {row['router']:<12} {row['rps']:>8.0f} "
            f"{_fmt(row['p50_ms']):>8} {_fmt(row['p99_ms']):>8} {_fmt(row.get('added_p50_ms')):>7} "
            f"{_fmt(row.get('added_p99_ms')):>7} {_fmt(row.get('ttft_p50_ms')):>7} {_fmt(row.get('ttft_p99_ms')):>7} "
            f"{row['errors']:>6} {_fmt(row.get('router_cpu_ms_per_req'), '.3f'):>10} {row['foreign_cores']:>6.2f}")
    if result["setup"] == "ceiling":
        lines.append("(ceiling: 'direct' is wrk against one instant backend, a single leg; +p50/+p99 are against it)")
    else:
        lines.append("(sim: 'direct' is the load generator doing the router's job itself; +p50/+p99 are against it)")
    lines.append("'others' = cores used meanwhile by processes outside this benchmark")
    ours = ("pd-router", *result.get("variants", {}))
    rows = [r for r in result["ratios"] if r["router"] in ours] or result["ratios"]
    if rows:
        lines += ["", f"{'router':<12} {'vs':<14} {'mode':<10} {'conc':>4} {'req/s x':>8} {'p50 x':>7} "
                      f"{'p99 x':>7} {'cpu/req x':>9}"]
        for r in sorted(rows, key=lambda r: (r["router"], r["vs"], r["mode"], r["concurrency"])):
            lines.append(f"{r['router']:<12} {r['vs']:<14} {r['mode']:<10} {r['concurrency']:>4} "
                         f"{_fmt(r['rps'], '.2f'):>8} {_fmt(r['p50'], '.2f'):>7} {_fmt(r['p99'], '.2f'):>7} "
                         f"{_fmt(r['cpu_per_req'], '.2f'):>9}")
        lines += _summary(result["ratios"], result["setup"], tuple(result.get("variants", {})))
    return "\n".join(lines)


def _summary(all_ratios: list[dict], setup: str, variants: tuple[str, ...] = ()) -> list[str]:
    lines = []
    pd = [r for r in all_ratios if r["router"] == "pd-router"]
    for router in ("pd-router", *variants):
        for baseline in BASELINES + (("pd-router",) if router in variants else ()):
            rows = [r for r in all_ratios if r["router"] == router and r["vs"] == baseline]
            if not rows:
                continue
            lines.append(f"{router} vs {baseline}: req/s x{geometric_mean([r['rps'] for r in rows])}, "
                         f"p99 x{geometric_mean([r['p99'] for r in rows])}, cpu/req "
                         f"x{geometric_mean([r['cpu_per_req'] for r in rows])} (geometric means over the points)")
    if setup == "ceiling":
        rows = [r for r in pd if r["vs"] == "mini_lb"]
        if rows:
            met = all(r["rps"] is not None and r["rps"] >= REQUIRED_RPS_VS_MINI_LB and r["p99"] is not None
                      and r["p99"] < 1 for r in rows)
            lines.append(f"issue 3 target (>= {REQUIRED_RPS_VS_MINI_LB:g}x mini_lb req/s with a lower p99 at every "
                         f"point): {'met' if met else 'NOT met'}")
    return lines


def markdown(result: dict) -> str:
    """The README's table for one setup: pd-router's ratios per point, then each router's own figures."""
    ratios = {(r["vs"], r["mode"], r["concurrency"]): r for r in result["ratios"] if r["router"] == "pd-router"}
    best = {(r["router"], r["mode"], r["concurrency"]): r for r in result["best"]}
    points = sorted({(m, c) for _, m, c in best}, key=lambda p: (p[0] != "non-stream", p[1]))
    head = "| " + result["setup"] + " | " + " | ".join(f"{m} c={c}" for m, c in points) + " |"
    lines = [head, "|" + "---|" * (len(points) + 1)]
    for baseline in BASELINES:
        if not any(vs == baseline for vs, _, _ in ratios):
            continue
        for field, label in (("rps", "req/s"), ("p99", "p99")):
            cells = [_fmt((ratios.get((baseline, m, c)) or {}).get(field), ".2f") for m, c in points]
            lines.append(f"| pd-router / {baseline} {label} | " + " | ".join(f"{x}x" if x != "-" else x
                                                                              for x in cells) + " |")
    for router in ("pd-router", "pd-router-base", "mini_lb", "sgl-router", DIRECT):
        if not any(router == r for r, _, _ in best):
            continue
        cells = []
        for m, c in points:
            row = best.get((router, m, c))
            if row is None:
                cells.append("-")
                continue
            text = f"{row['rps']:.0f} req/s, p99 {row['p99_ms']:.0f} ms"
            if row.get("ttft_p99_ms") is not None:
                text += f", TTFT p99 {row['ttft_p99_ms']:.0f} ms"
            if router != DIRECT:
                text += f", {row['router_cpu_ms_per_req']:.2f} cpu-ms/req"
            cells.append(text)
        lines.append(f"| {router} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


CHART_METRICS = {"rps": ("requests per second", ""), "router_cpu_ms_per_req": ("router CPU per request, ms", "")}


def chart(result: dict, metric: str = "rps") -> str:
    """One saved run as an SVG: a group per point (mode and connections), a bar per router (the direct baseline
    left out: it is no router), the metric from each router's best round."""
    from bench import charts

    title, unit = CHART_METRICS[metric]
    best = [r for r in result["best"] if r["router"] != DIRECT]
    points = sorted({(r["mode"], r["concurrency"]) for r in best}, key=lambda p: (p[0] != "non-stream", p[1]))
    # the peers first (mini_lb takes the palette's grey, a baseline's colour), pd-router last
    routers = [name for name in ("mini_lb", "sgl-router", "smg", "pd-router-base", *result.get("variants", {}),
                                 "pd-router") if any(r["router"] == name for r in best)]
    by_key = {(r["router"], r["mode"], r["concurrency"]): r for r in best}
    series = {name: [float((by_key.get((name, m, c)) or {}).get(metric) or 0.0) for m, c in points]
              for name in routers}
    tallest = max([v for values in series.values() for v in values] or [1.0])
    step = 10 ** math.floor(math.log10(tallest)) if tallest > 0 else 1.0
    return charts.grouped_bars(f"{result['setup']}: {title} (best round per point; higher is better)"
                               if metric == "rps" else f"{result['setup']}: {title} (lower is better)",
                               [f"{m} c={c}" for m, c in points], series, unit=unit,
                               y_max=step * math.ceil(tallest / step))  # round gridlines


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.report RESULT.json`: print a saved run again, or (--markdown) its README table;
    --chart PATH / --cpu-chart PATH draw its requests per second / router CPU per request as SVG."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("result", help="a JSON file written by python -m bench.routers")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--chart", help="write its requests per second as an SVG chart here (one setup per run)")
    parser.add_argument("--cpu-chart", help="write its router CPU per request as an SVG chart here")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        data = json.load(f)
    results = data if isinstance(data, list) else [data]
    for result in results:
        print(markdown(result) if args.markdown else render(result))
    from pathlib import Path

    from bench import charts

    for path, metric in ((args.chart, "rps"), (args.cpu_chart, "router_cpu_ms_per_req")):
        if path:
            print(f"chart: {charts.write(Path(path), chart(results[0], metric))}")


if __name__ == "__main__":
    main()
