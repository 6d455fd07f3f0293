"""What the OpenAI-compatible API accepts, refuses and makes of a request body; stop strings over a streamed text."""

from __future__ import annotations

import pytest

from swarm.errors import BadRequest
from swarm.leader.api.openai_params import parse_chat_body
from swarm.leader.chat.stops import StopFinder

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(**fields):
    return parse_chat_body({**BASE, **fields}, 4096)


@pytest.mark.parametrize("field, value", [
    ("web_search_options", {}),
    ("prediction", {"type": "content", "content": "x"}),
    ("functions", [{"name": "f"}]),
    ("audio", {"voice": "alloy"}),
    ("best_of", 3),
    ("made_up_field", 1),
])
def test_what_we_do_not_implement_is_refused_by_name(field, value):
    with pytest.raises(BadRequest) as info:
        parse(**{field: value})
    assert f"'{field}'" in str(info.value) and "not supported" in str(info.value)
    assert info.value.code == "unsupported_parameter"


def test_what_clients_send_anyway_is_accepted():
    params = parse(user="u-1", metadata={"a": "b"}, store=False, stream_options={"include_usage": True},
                   service_tier="auto", logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="none",
                   top_p=None, safety_identifier="x", prompt_cache_key="k")
    assert params.model == "m" and params.sampling == {}


def test_reasoning_effort_is_the_level_and_the_switch():
    assert (parse(reasoning_effort="high").effort, parse(reasoning_effort="high").thinking) == ("high", True)
    assert parse(reasoning_effort="none").thinking is False and parse(reasoning_effort="minimal").thinking is False
    # enable_thinking, sent as well, is the switch; the level still reaches gpt-oss's template
    both = parse(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert (both.effort, both.thinking) == ("low", False)
    assert parse(chat_template_kwargs={"reasoning_effort": "medium"}).effort == "medium"  # vLLM's way
    assert (parse().effort, parse().thinking) == (None, None)
    with pytest.raises(BadRequest, match="'reasoning_effort' is 'max'") as info:
        parse(reasoning_effort="max")
    assert info.value.code == "invalid_reasoning_effort"


def test_max_completion_tokens_is_max_tokens():
    assert parse(max_completion_tokens=7).max_tokens == 7
    assert parse(max_tokens=9).max_tokens == 9
    with pytest.raises(BadRequest, match="at most 4096"):
        parse(max_completion_tokens=5000)


def test_stop_is_a_string_or_up_to_four():
    assert parse(stop="\n").stop == ["\n"]
    assert parse(stop=["a", "b", "a", ""]).stop == ["a", "b"]
    with pytest.raises(BadRequest, match="up to 4"):
        parse(stop=["a", "b", "c", "d", "e"])
    with pytest.raises(BadRequest):
        parse(stop=[1])


def feed(finder: StopFinder, pieces: list[str]) -> list[str]:
    out = [finder.push(p) for p in pieces]
    out.append(finder.flush())
    return out


def test_a_stop_string_split_over_deltas_ends_the_text_before_it():
    finder = StopFinder(["three"])
    out = feed(finder, ["One", " two", " th", "r", "ee", " four"])
    assert "".join(out) == "One two " and finder.stopped
    # only what could still become the stop string was held back
    assert out[:3] == ["One", " two", " "]


def test_text_that_only_looked_like_a_stop_string_goes_out():
    finder = StopFinder(["5."])
    out = feed(finder, ["Count to 5", " now"])
    assert out == ["Count to ", "5 now", ""] and not finder.stopped
    finder = StopFinder(["xyz"])
    assert feed(finder, ["ab", "xy"]) == ["ab", "", "xy"]  # the end of the reply releases what was held


def test_the_earliest_of_several_stop_strings_wins():
    finder = StopFinder(["world", "lo w"])
    assert "".join(feed(finder, ["hello world"])) == "hel"


def test_n_logprobs_and_penalties_are_checked():
    params = parse(n=3, logprobs=True, top_logprobs=5, presence_penalty=0.5, frequency_penalty=0,
                   repetition_penalty=1.1)
    assert (params.n, params.logprobs) == (3, 5)
    assert params.sampling == {"presence_penalty": 0.5, "repetition_penalty": 1.1}  # 0 is off: not sent
    assert parse(logprobs=True).logprobs == 0 and parse(logprobs=False, top_logprobs=0).logprobs is None
    for bad in ({"n": 9}, {"n": 0}, {"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2},
                {"presence_penalty": 2.5}, {"repetition_penalty": 0}, {"logprobs": "yes"}):
        with pytest.raises(BadRequest):
            parse(**bad)


def test_choices_get_seeds_of_their_own():
    from swarm.leader.api.openai_params import choice_seed, to_sampling

    seeds = [choice_seed(42, i) for i in range(1, 8)]
    assert len(set(seeds)) == 7 and 42 not in seeds and all(0 <= s < 1 << 63 for s in seeds)
    sampling = to_sampling({"temperature": 0.5, "presence_penalty": 1.0}, logprobs=2)
    assert sampling.seed is not None and sampling.penalised and sampling.logprobs == 2
    assert not to_sampling({}).penalised and to_sampling({}).seed is None


def test_completion_prompts_and_their_limits():
    from swarm.leader.api.completion_params import parse_completion_body

    def parse_completion(**fields):
        return parse_completion_body({"model": "m", **fields}, 4096)

    assert parse_completion(prompt="hi").prompts == ["hi"]
    assert parse_completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert parse_completion(prompt=["a", [4, 5]]).prompts == ["a", [4, 5]]
    params = parse_completion(prompt="x", echo=True, logprobs=1, max_tokens=0, best_of=1, suffix="")
    assert (params.echo, params.logprobs, params.max_tokens) == (True, 1, 0)
    assert parse_completion(prompt="x").max_tokens == 16  # OpenAI's default for this route
    for bad in ({"prompt": ""}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": "x", "logprobs": 21},
                {"prompt": "x", "echo": "yes"}, {"prompt": ["x"] * 33}):
        with pytest.raises(BadRequest):
            parse_completion(**bad)
    with pytest.raises(BadRequest, match="'suffix'"):
        parse_completion(prompt="x", suffix="def f():")
    with pytest.raises(BadRequest, match="'best_of'"):
        parse_completion(prompt="x", best_of=3)


def test_tools_and_tool_choice():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert parse(tools=[tool]).tools == [tool]
    assert parse(tools=[tool], tool_choice="auto").tools == [tool]
    assert parse(tools=[tool], tool_choice="none").tools is None
    assert parse(tools=[], tool_choice="none").tools is None
    assert parse(tools=[tool]).forced_tool is None
    assert parse(tools=[tool], tool_choice="required").forced_tool == "*"
    assert parse(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}).forced_tool == "f"
    for bad in ({"tools": [{"type": "function"}]}, {"tools": "f"}, {"tool_choice": "required"},
                {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                {"tools": [tool], "tool_choice": "always"},
                {"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(BadRequest):
            parse(**bad)


def test_a_forced_call_is_a_grammar_of_the_familys_format():
    import llguidance
    import llguidance.hf
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from swarm.leader.chat.tool_calls import forced_grammar

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 10], vocab_size=260, min_frequency=2, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    bytes_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    now = {"type": "function", "function": {"name": "now"}}

    def follows(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(bytes_tokenizer, grammar)
        ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok and matcher.is_accepting()

    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert follows(forced_grammar([weather, now], "hermes"), f"<tool_call>\n{call}\n</tool_call>")
    assert follows(forced_grammar([weather, now], "hermes"),
                   '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not follows(forced_grammar([weather, now], "hermes", "now"), f"<tool_call>\n{call}\n</tool_call>")
    assert not follows(forced_grammar([weather, now], "hermes"), "It is sunny")
    assert not follows(forced_grammar([weather], "hermes"),  # the schema's required city is missing
                       '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert follows(forced_grammar([weather], "llama"), '{"name": "get_weather", "parameters": {"city": "Paris"}}')


def test_response_format_becomes_a_grammar():
    assert parse(response_format={"type": "text"}).grammar is None
    assert '"type":"object"' in parse(response_format={"type": "json_object"}).grammar.replace(" ", "")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = parse(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).grammar
    assert '"required":["n"]' in grammar.replace(" ", "")
    for bad in ({"type": "json_schema"}, {"type": "yaml"}, "json",
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}):
        with pytest.raises(BadRequest):
            parse(response_format=bad)


def test_logit_bias():
    assert parse(logit_bias={"15": -100, "7": 2.5}).sampling["logit_bias"] == {15: -100.0, 7: 2.5}
    assert "logit_bias" not in parse(logit_bias={}).sampling
    for bad in ({"x": 1}, {"-1": 1}, {"5": 101}, {"5": True}, [1]):
        with pytest.raises(BadRequest):
            parse(logit_bias=bad)
    from swarm.leader.api.openai_params import to_sampling

    sampling = to_sampling({"logit_bias": {15: -100.0}})
    assert (sampling.bias_ids, sampling.bias_values) == ([15], [-100.0])
