"""bench.report: best point per router, added latency, ratios and the issue-3 verdict."""

from bench import report


def row(router, rps, p50, p99, *, conc=64, mode="non-stream", cpu=None, round_no=1):
    return {"router": router, "mode": mode, "concurrency": conc, "round": round_no, "rps": rps,
            "p50_ms": p50, "p99_ms": p99, "errors": 0, "router_cpu_ms_per_req": cpu, "foreign_cores": 0.0,
            "load1_at_start": 0.0}


def test_best_rows_keeps_fastest_round_and_adds_latency_over_direct():
    rows = [row("direct", 5000, 1.0, 2.0), row("mini_lb", 300, 100, 200, round_no=1),
            row("mini_lb", 400, 90, 180, round_no=2)]
    best = {r["router"]: r for r in report.best_rows(rows)}
    assert best["mini_lb"]["round"] == 2
    assert best["mini_lb"]["added_p50_ms"] == 89.0
    assert best["mini_lb"]["added_p99_ms"] == 178.0
    assert "added_p50_ms" not in best["direct"]


def test_ratios_against_each_baseline():
    best = report.best_rows([row("pd-router", 1200, 10, 40, cpu=0.5), row("mini_lb", 400, 100, 200, cpu=2.5),
                             row("sgl-router", 2400, 5, 20, cpu=0.25)])
    got = {(r["router"], r["vs"]): r for r in report.ratios(best)}
    assert got[("pd-router", "mini_lb")]["rps"] == 3.0
    assert got[("pd-router", "mini_lb")]["p99"] == 0.2
    assert got[("pd-router", "mini_lb")]["cpu_per_req"] == 0.2
    assert got[("pd-router", "sgl-router")]["rps"] == 0.5
    assert ("mini_lb", "mini_lb") not in got


def test_summary_reports_whether_issue_3_target_is_met():
    def verdict(pd_rps, pd_p99):
        best = report.best_rows([row("pd-router", pd_rps, 10, pd_p99), row("mini_lb", 400, 100, 200)])
        text = "\n".join(report._summary(report.ratios(best), "ceiling"))
        return "NOT met" not in text and "met" in text

    assert verdict(1300, 150)
    assert not verdict(1000, 150)  # under 3x
    assert not verdict(1300, 250)  # p99 not lower


def test_geometric_mean_ignores_missing():
    assert report.geometric_mean([2.0, 8.0, None]) == 4.0
    assert report.geometric_mean([None]) is None


def test_markdown_table_has_ratios_and_figures_per_point():
    rows = [row("direct", 5000, 1, 2, conc=16), row("pd-router", 1200, 10, 40, conc=16, cpu=0.5),
            row("mini_lb", 400, 100, 200, conc=16, cpu=2.0), row("sgl-router", 2400, 5, 20, conc=16, cpu=0.25)]
    best = report.best_rows(rows)
    table = report.markdown({"setup": "ceiling", "best": best, "ratios": report.ratios(best)})
    lines = table.splitlines()
    assert lines[0] == "| ceiling | non-stream c=16 |"
    assert "| pd-router / mini_lb req/s | 3.00x |" in lines
    assert "| pd-router / sgl-router p99 | 2.00x |" in lines
    assert "| mini_lb | 400 req/s, p99 200 ms, 2.00 cpu-ms/req |" in lines


def test_baseline_checkout_is_a_ratio_baseline_and_a_markdown_row():
    best = report.best_rows([row("pd-router", 1000, 10, 40, cpu=0.30), row("pd-router-base", 1250, 9, 32, cpu=0.25)])
    got = {(r["router"], r["vs"]): r for r in report.ratios(best)}
    assert got[("pd-router", "pd-router-base")]["rps"] == 0.8
    assert got[("pd-router", "pd-router-base")]["cpu_per_req"] == 1.2
    table = report.markdown({"setup": "ceiling", "best": best, "ratios": report.ratios(best)})
    assert "| pd-router / pd-router-base req/s | 0.80x |" in table
    assert "pd-router / mini_lb" not in table  # baselines absent from the run get no empty rows
