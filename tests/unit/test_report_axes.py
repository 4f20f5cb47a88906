"""`launch report`'s axes (issue 42): one scale per axis, and a step-time axis no start-up wait sets.

A run directory written here the way the trainer writes metrics.jsonl (the embedded default's scales:
the trainer ~3000 tokens/s, the servers ~60 generated tokens/s, a 45 s wait for the first batch, ~1 s
later), rendered by the real `launch.report.render`; the page's SVG is read back: each chart's y tick
labels, and each point's shape and tooltip.
"""
from __future__ import annotations

import json
import re

import yaml

from launch import report, report_svg


def _run(tmp_path, first_wait: float = 45.0):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"experiment": "debug", "trainer": {"max_steps": 12}}))
    rows = [{"step": s, "time": 1000.0 + s, "loss": 0.1, "reward_mean": 0.5, "tokens_per_s": 2900.0 + 20 * s,
             "orchestrator/gen_tokens_per_s": 55.0 + s, "step_time_s": 0.2,
             "wait_s": first_wait if s == 0 else 0.8 + 0.05 * (s % 3), "publish_s": 0.1} for s in range(12)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _charts(page: str) -> dict[str, str]:
    out = {}
    for fig in page.split('<figure class="chart">')[1:]:
        out[re.search(r"<figcaption>(.*?)</figcaption>", fig).group(1)] = fig.split("</figure>")[0]
    return out


def _y_ticks(fig: str) -> list[str]:
    return re.findall(r'class="tick" text-anchor="end">([^<]*)<', fig)


def test_trainer_and_inference_throughput_have_their_own_axes(tmp_path):
    charts = _charts(report.render(_run(tmp_path), steps=0))
    assert "Throughput" not in charts
    trainer, inference = charts["Trainer throughput"], charts["Inference throughput"]
    assert "inference gen tokens/s" not in trainer and "trainer tokens/s" not in inference
    # each axis spans its own series: ~60 is not drawn against a 0-3000 scale
    assert max(float(t) for t in _y_ticks(trainer)) >= 3120, _y_ticks(trainer)
    top = max(float(t) for t in _y_ticks(inference))
    assert 66 <= top <= 100, _y_ticks(inference)


def test_the_step_time_axis_is_not_scaled_by_the_start_up_wait(tmp_path):
    fig = _charts(report.render(_run(tmp_path), steps=0))["Step time"]
    top = max(float(t) for t in _y_ticks(fig))
    assert 0.9 <= top < 5, _y_ticks(fig)     # the ~1 s waits fill the chart, not 1/45 of it
    # step 0 sits on the top edge as an open triangle with its true value, and the note names it
    tri = re.findall(r'<polygon [^>]*class="above"><title>([^<]*)</title>', fig)
    assert tri == ["wait for batch s @ step 0: 45"], tri
    assert "y axis cut at" in fig and "wait for batch s @ step 0: 45" in fig.split('class="note"')[1]
    assert len(re.findall(r"<circle ", fig)) == 3 * 12 - 1   # every other point drawn where it is


def test_without_an_outlier_the_axis_is_the_data_range(tmp_path):
    fig = _charts(report.render(_run(tmp_path, first_wait=0.9), steps=0))["Step time"]
    assert "class=\"above\"" not in fig and "y axis cut" not in fig
    assert len(re.findall(r"<circle ", fig)) == 3 * 12
    assert report_svg.robust_top([1.0, 50.0, 1.0]) is None          # too few points to call one an outlier
    assert report_svg.robust_top([1.0] * 8 + [50.0, 40.0]) == 3.0   # step 0 and a restart
    assert report_svg.robust_top([1.0] * 9 + [2.5]) is None
