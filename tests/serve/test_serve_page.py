"""The web page in a real headless browser (Chromium, Selenium): load it, change fields, and read the
numbers it shows against `trainfit estimate --json`; apply a suggested fix; download the TOML and
estimate it with the command; a bad value shows its named error beside the field and changes nothing
else; the shared URL restores the same state; the plan tab lists the command's plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _browser import chromium, wait_for
from _server import running

pytestmark = pytest.mark.slow  # a browser start and a page per test: seconds each


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    downloads = tmp_path_factory.mktemp("downloads")
    with running() as base, chromium(downloads) as driver:
        driver.downloads = downloads
        driver.base = base
        yield driver


def cli_estimate(values: dict[str, str], config: str | None = None) -> dict:
    args = [sys.executable, "-m", "trainfit", "estimate", *([config] if config else []), "--json",
            *(f"--{k}={v}" for k, v in values.items())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def open_page(driver, url: str | None = None) -> None:
    driver.get(url or driver.base + "/")
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), "the page to load")
    settled(driver)


def settled(driver, after: int = 0) -> int:
    """The page's estimate sequence number once its latest answer is shown (later than `after`)."""
    return wait_for(lambda: int(driver.execute_script("return document.body.dataset.settled || 0")) > after and
                    not driver.execute_script("return document.getElementById('status').textContent") and
                    int(driver.execute_script("return document.body.dataset.settled")), "the estimate")


def set_field(driver, key: str, value: str) -> None:
    """Type into a field (or pick an option) as a person would, then wait for the answer."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    before = int(driver.execute_script("return document.body.dataset.settled || 0"))
    node = driver.find_element("id", f"f_{key}")
    driver.execute_script("arguments[0].closest('details').open = true; arguments[0].scrollIntoView()", node)
    if node.tag_name == "select":
        Select(node).select_by_value(value)
    else:
        node.clear()
        node.send_keys(value, Keys.TAB)
    settled(driver, before)


def shown(driver) -> dict[str, float]:
    """The numbers the page shows, from the elements that show them."""
    def value(element_id: str, attribute: str = "data-value") -> float:
        return float(driver.find_element("id", element_id).get_attribute(attribute))

    return {"memory_bytes": value("verdict", "data-memory-bytes"), "step_time_s": value("step_ms"),
            "tokens_per_second": value("tokens_per_s"), "mfu": value("mfu"),
            "fits": driver.find_element("id", "verdict").get_attribute("data-fits") == "true",
            **{rect.get_attribute("data-component"): float(rect.get_attribute("data-bytes"))
               for rect in driver.find_elements("css selector", "#memory_chart rect")}}


def expected(answer: dict) -> dict[str, float]:
    worst, time_ = answer["per_rank"], answer["time"]
    components = ("params", "master_params", "grads", "optimizer", "activations", "logits", "buffers",
                  "reserved_margin")
    return {"memory_bytes": worst["peak"] + worst["reserved_margin"], "step_time_s": time_["step_time_s"],
            "tokens_per_second": time_["tokens_per_second"], "mfu": time_["mfu"], "fits": answer["fits"],
            **{name: worst[name] for name in components if worst[name] > 0}}


def test_changed_fields_show_the_commands_numbers(page) -> None:
    open_page(page)
    assert shown(page) == expected(cli_estimate({}))
    values = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "8",
              "parallel.zero_stage": "3", "precision.mode": "bf16-mixed", "training.seq_len": "4096",
              "training.micro_batch_size": "1", "memory.activation_checkpointing": "full"}
    for key, value in values.items():
        set_field(page, key, value)
    assert shown(page) == expected(cli_estimate(values))
    assert page.find_element("id", "verdict").text.startswith("Fits")


def test_a_suggested_fix_applies_with_one_click(page) -> None:
    open_page(page)
    set_field(page, "model.preset", "llama3-8b")
    set_field(page, "hardware.gpu", "H100-SXM-80GB")
    assert page.find_element("id", "verdict").get_attribute("data-fits") == "false"
    wait_for(lambda: page.find_elements("id", "apply_0"), "the fixes")
    before = settled(page)
    page.find_element("id", "apply_0").click()
    settled(page, before)
    assert page.find_element("id", "verdict").get_attribute("data-fits") == "true"
    changed = page.execute_script("return state.values")
    assert shown(page) == expected(cli_estimate(changed))


def test_a_faster_change_of_method_applies_with_one_click(page) -> None:
    """Llama 3 8B on one RTX 4090: the fixes offload the optimizer; LoRA with checkpointing, bf16 weights
    and the chunked loss fits faster, and is drawn apart, applicable as the fixes are."""
    open_page(page)
    set_field(page, "model.preset", "llama3-8b")
    set_field(page, "hardware.gpu", "RTX-4090")
    wait_for(lambda: page.find_elements("id", "method_0"), "the changes of method")
    assert "8.03B parameters" in page.find_element("id", "verdict").text
    fastest_fix = max(f["tokens_per_second"] for f in page.execute_script("return state.answer.fixes"))
    method = page.execute_script("return state.answer.method_changes[0]")
    assert method["tokens_per_second"] > fastest_fix and "frozen base" in page.find_element("id", "method_table").text
    before = settled(page)
    page.find_element("id", "method_0").click()
    settled(page, before)
    changed = page.execute_script("return state.values")
    assert changed["peft.method"] == "lora" and changed["precision.mode"] == "bf16-pure"
    assert page.find_element("id", "verdict").get_attribute("data-fits") == "true"
    assert shown(page) == expected(cli_estimate(changed))


def test_a_path_the_server_may_not_read_is_named_beside_its_field(page) -> None:
    open_page(page)
    assert " parameters)" in page.find_element("id", "verdict").text  # the tiny default counts in M or K, not 0.00B
    assert "0.00B" not in page.find_element("id", "verdict").text
    good = shown(page)
    set_field(page, "model.preset", "/etc/passwd")
    error = page.find_element("id", "e_model.preset").text
    assert "model.preset='/etc/passwd'" in error and "--files" in error and "root:" not in error
    assert shown(page) == good


def test_the_downloaded_toml_estimates_the_same_with_the_command(page) -> None:
    open_page(page)
    set_field(page, "model.preset", "llama3-8b")
    set_field(page, "training.micro_batch_size", "2")
    page.find_element("id", "toml_btn").click()
    wait_for(lambda: page.find_element("id", "toml_text").get_attribute("value"), "the TOML")
    page.find_element("id", "toml_download").click()
    path = wait_for(lambda: next(iter(page.downloads.glob("trainfit*.toml")), None), "the download")
    assert shown(page) == expected(cli_estimate({}, config=str(path)))


def test_a_bad_value_is_named_beside_its_field_and_changes_nothing_else(page) -> None:
    open_page(page)
    set_field(page, "model.preset", "llama3-8b")
    good, values = shown(page), page.execute_script("return {...state.values}")
    set_field(page, "training.seq_len", "-5")
    error = page.find_element("id", "e_training.seq_len").text
    assert error == cli_error({"model.preset": "llama3-8b", "training.seq_len": "-5"})
    assert "training.seq_len=-5" in error
    assert shown(page) == good  # the last good estimate stays
    assert page.execute_script("return state.values") == {**values, "training.seq_len": "-5"}
    set_field(page, "training.seq_len", "")  # back to the default: the error goes
    assert page.find_element("id", "e_training.seq_len").text == "" and shown(page) == good


def cli_error(values: dict[str, str]) -> str:
    args = [sys.executable, "-m", "trainfit", "estimate", *(f"--{k}={v}" for k, v in values.items())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    return proc.stderr.strip().removeprefix("error: ")


def test_the_shared_url_restores_the_page(page) -> None:
    open_page(page)
    set_field(page, "model.preset", "mixtral-8x7b")
    set_field(page, "hardware.gpu", "H100-SXM-80GB")
    set_field(page, "hardware.num_gpus", "16")
    set_field(page, "parallel.ep", "8")
    url, numbers = page.current_url, shown(page)
    page.get("about:blank")
    open_page(page, url)
    assert page.execute_script("return state.values") == {
        "model.preset": "mixtral-8x7b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "16", "parallel.ep": "8"}
    assert page.find_element("id", "f_parallel.ep").get_attribute("value") == "8"
    assert shown(page) == numbers


def test_the_plan_tab_lists_the_commands_plan(page) -> None:
    open_page(page)
    for key, value in {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "8",
                       "training.global_batch_size": "64"}.items():
        set_field(page, key, value)
    page.find_element("id", "tab_plan").click()
    page.find_element("id", "plan_top").clear()
    page.find_element("id", "plan_top").send_keys("5")
    page.find_element("id", "plan_go").click()
    rows = wait_for(lambda: page.find_elements("css selector", "#plan_candidates tr")[1:], "the plan")
    args = [sys.executable, "-m", "trainfit", "plan", "--json", "--top", "5", "--model.preset=llama3-8b",
            "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8", "--training.global_batch_size=64"]
    plan = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert len(rows) == len(plan["candidates"])
    for row, candidate in zip(rows, plan["candidates"], strict=True):
        assert candidate["layout"] in row.text
    assert len(page.find_elements("css selector", "#plan_svg circle")) == len(plan["candidates"])


def test_pipeline_stages_get_a_bar_each_and_a_config_json_upload_sets_the_model(page, tmp_path) -> None:
    open_page(page)
    values = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "4",
              "parallel.pp": "4", "training.micro_batch_size": "1", "training.global_batch_size": "8"}
    for key, value in values.items():
        set_field(page, key, value)
    stages = cli_estimate(values)["per_stage"]
    labels = [t.text for t in page.find_elements("css selector", "#memory_chart text") if t.text.startswith("stage")]
    assert labels == [f"stage {s['stage']}" for s in stages] and len(stages) == 4
    drawn = [float(r.get_attribute("data-bytes")) for r in page.find_elements("css selector", "#memory_chart rect")
             if r.get_attribute("data-component") == "activations"]
    assert drawn == [s["activations"] for s in stages]
    hf = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    before = settled(page)
    page.find_element("id", "hf_file").send_keys(str(tmp_path / "config.json"))
    settled(page, before)
    assert page.find_element("id", "f_model.dim").get_attribute("value") == "1024"
    assert page.find_element("id", "f_model.preset").get_attribute("value") == ""
    state = page.execute_script("return state.values")
    assert shown(page) == expected(cli_estimate(state))
