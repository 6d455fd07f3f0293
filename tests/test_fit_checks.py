"""Early checks over made-up PCs and catalogues: what one stage on a PC can hold, budgeted as placement budgets it."""

from __future__ import annotations

from swarm.leader.planning.fit_checks import fit_report
from swarm.leader.planning.placement import GB, OVERHEAD_BYTES
from swarm.messages import Gpu, Hardware

MB = 1_000_000


def manifest(layers: int, layer_bytes: int, embed: int, kv_per_token: int, dtype: str = "bfloat16") -> dict:
    files = [{"kind": "layer", "layer": i, "size": layer_bytes} for i in range(layers)]
    files.append({"kind": "embed", "size": embed})
    return {"num_layers": layers, "files": files, "dtype": dtype, "tie_word_embeddings": True,
            "kv_bytes_per_token": kv_per_token}


SMALL = manifest(30, 6 * MB, 57 * MB, 1536)  # about SmolLM2-135M in bfloat16
BIG = manifest(40, 700 * MB, 1500 * MB, 10240)  # about a 14B model in bfloat16


def gpu_pc(free: int) -> Hardware:
    return Hardware(8, 32 * 10**9, 20 * 10**9, [Gpu(0, "RTX 3060", 12 * 10**9, free)])


def test_a_gpu_pc_holds_part_of_a_big_model_and_all_of_a_small_one():
    report = fit_report(gpu_pc(6_100_000_000), 500 * GB, [("Qwen3-14B", BIG), ("smollm2-135m-instruct", SMALL)],
                        context_tokens=4096)
    per_layer = 700 * MB + 10240 * 4096
    expected = (6_100_000_000 - OVERHEAD_BYTES) // per_layer
    assert expected == 7
    assert report["text"] == ("This PC can hold up to 7 of 40 layers of Qwen3-14B at 16 bits (6.1 GB free on the "
                              "RTX 3060); smollm2-135m-instruct fits whole.")
    fits = {m["model"]: m for m in report["models"]}
    assert (fits["Qwen3-14B"]["layers"], fits["Qwen3-14B"]["whole"]) == (7, False)
    assert fits["smollm2-135m-instruct"]["whole"] and fits["smollm2-135m-instruct"]["layers"] == 30


def test_a_cpu_pc_budgets_weights_widened_to_float32():
    cpu = Hardware(4, 16 * 10**9, 3 * 10**9)
    report = fit_report(cpu, None, [("Qwen3-14B", BIG)], context_tokens=1024)
    per_layer = 2 * 700 * MB + 2 * 10240 * 1024  # float32 on a CPU: twice the stored bfloat16
    assert report["models"][0]["layers"] == (3 * 10**9 - OVERHEAD_BYTES) // per_layer == 1
    assert report["text"] == "This PC can hold up to 1 of 40 layers of Qwen3-14B at 32 bits (3.0 GB of RAM free)."


def test_free_disk_limits_what_a_roomy_pc_holds_and_a_tiny_one_holds_nothing():
    report = fit_report(gpu_pc(80 * 10**9), 2_200 * MB, [("Qwen3-14B", BIG)])
    assert report["models"][0]["layers"] == 3 and report["models"][0]["limited_by"] == "disk"
    assert report["text"].endswith("(80.0 GB free on the RTX 3060, limited by free disk).")
    tiny = fit_report(Hardware(2, 4 * 10**9, 300 * MB), None, [("Qwen3-14B", BIG)])
    assert tiny["text"] == "Qwen3-14B does not fit: not one of its layers (0.3 GB of RAM free)."
    empty = fit_report(gpu_pc(10**9), None, [])
    assert empty["text"].startswith("The leader's catalogue is empty")


def test_a_gguf_kept_as_blocks_is_held_as_its_values_and_stored_as_its_blocks():
    """A Q4 GGUF's layer: 100 MB of blocks on disk holding 350 M values -- 1.4 GB in float32 on a CPU; the disk limit
    counts the blocks, the memory limit the values."""
    blocks = manifest(40, 100 * MB, 200 * MB, 10240)
    for f in blocks["files"]:
        f["params"] = f["size"] * 7 // 2
    blocks["storage"] = "gguf"
    roomy_disk = fit_report(Hardware(4, 64 * 10**9, 3 * 10**9), 10 * GB, [("q4", blocks)], context_tokens=1024)
    per_layer = 4 * 350 * MB + 2 * 10240 * 1024
    assert roomy_disk["models"][0]["layers"] == (3 * 10**9 - OVERHEAD_BYTES) // per_layer == 1
    small_disk = fit_report(Hardware(4, 64 * 10**9, 60 * 10**9), 350 * MB, [("q4", blocks)], context_tokens=1024)
    assert small_disk["models"][0]["layers"] == 3 and small_disk["models"][0]["limited_by"] == "disk"
