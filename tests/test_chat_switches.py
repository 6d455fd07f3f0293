"""The families' reasoning switches as the chat templates get them, and where a prompt leaves the thinking block."""

from __future__ import annotations

from swarm.leader.chat.chat_format import harmony_message, reasoning_kwargs, sampling_defaults
from swarm.leader.chat.reasoning import CLOSED, OPENED, split


def test_reasoning_effort_is_gpt_oss_level_and_the_others_switch():
    assert reasoning_kwargs("gpt_oss", None, "high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert reasoning_kwargs("gpt_oss", False, None) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert reasoning_kwargs("gpt_oss", None, "xhigh")["reasoning_effort"] == "high"
    assert reasoning_kwargs("gpt_oss", None, None) == {}  # the template's own default (medium)
    assert reasoning_kwargs("glm4_moe", None, "none") == {"enable_thinking": False}
    assert reasoning_kwargs("qwen3_moe", None, "low") == {"enable_thinking": True}
    assert reasoning_kwargs("qwen3_moe", False, "high") == {"enable_thinking": False}  # the switch, sent, wins
    assert sampling_defaults("qwen3_moe", True) == sampling_defaults("qwen3", True)  # Qwen3-30B-A3B is a Qwen3


def test_gpt_oss_gets_a_tool_call_turns_reasoning_instead_of_its_preamble():
    call = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    assert (harmony_message(call)["thinking"], harmony_message(call)["content"]) == ("Need the tool.", "")
    answer = {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}
    assert harmony_message(answer) == {**answer, "thinking": "Easy."}
    assert harmony_message({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}


def test_a_prompt_that_closed_the_block_leaves_only_the_answer():
    assert split("\nJust 4.", CLOSED) == ("", "Just 4.")  # GLM-4.5, thinking off: its line break is not the answer's
    assert split("\nJust 4.") == ("", "\nJust 4.")  # with no block in the prompt, the reply is as it came
    assert split("Four.</think>\n\n4", OPENED) == ("Four.", "4")
