"""Every field of OpenAI's chat and completions requests is honoured or refused, never ignored; a
field OpenAI does not define is refused as OpenAI refuses it. `prediction` (Predicted Outputs) is
honoured: its tokens are drafts, so the answer is the one without it, and usage counts them."""
import json

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}


def post(url, **kw):
    return httpx.post(url, timeout=120, **kw)


@pytest.mark.parametrize("path,extra,param,needle", [
    ("chat", {"temprature": 0.5}, "temprature", "Unrecognized request argument supplied: temprature"),
    ("text", {"skip_special_tokens": False}, "skip_special_tokens", "Unrecognized request argument"),
    ("text", {"prediction": {"type": "content", "content": "x"}}, "prediction", "Unrecognized"),  # chat only
    ("chat", {"store": True}, "store", "store=True is not supported"),
    ("chat", {"service_tier": "flex"}, "service_tier", "not supported"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
    ("chat", {"verbosity": "low"}, "verbosity", "not supported"),
    ("chat", {"web_search_options": {}}, "web_search_options", "not supported"),
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ("chat", {"stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo", "Extra inputs"),
    ("chat", {"prediction": {"type": "image", "content": "x"}}, "prediction.type", "'content'"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "nmae": "x"}]}, "messages.0.nmae", "Extra inputs"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "refusal": "no"}]}, "messages.0", "'refusal'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
     "messages.0.content.0", "a text part has 'type' and 'text' only, not 'x'"),
])
def test_fields_not_honoured_are_refused(serve, path, extra, param, needle):
    s = serve()
    body = {**CHAT, **extra} if path == "chat" else {"prompt": "a", "max_tokens": 2, **extra}
    r = post(s.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions"), json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err


def test_fields_that_change_no_output_are_accepted_at_any_value(serve):
    s = serve()
    plain = post(s.url + "/v1/chat/completions", json=CHAT).json()
    extra = {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "h", "prompt_cache_key": "p",
             "store": False, "service_tier": "auto", "modalities": ["text"], "reasoning_effort": None,
             "stream_options": None}
    r = post(s.url + "/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]


def test_message_name_reaches_the_chat_template(serve, model):
    s = serve()
    seen = []
    real = s.srv._chat_prompt

    def spy(r, tp, cancelled=None):
        seen.append([m.name for m in r.messages])
        return real(r, tp, cancelled)
    s.srv._chat_prompt = spy
    r = post(s.url + "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi", "name": "a"}]})
    assert r.status_code == 200 and seen == [["a"]]


def test_prediction_is_honoured_and_never_changes_the_answer(serve, model):
    s = serve()
    body = {**CHAT, "max_tokens": 40, "temperature": 0}
    want = post(s.url + "/v1/chat/completions", json=body).json()
    text = want["choices"][0]["message"]["content"]
    assert want["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    for guess, good in ((text, True), (text[:10] + "XYZ" + text[14:], True), ("nothing like it " * 5, False),
                        ([{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}], True)):
        for stream in (False, True):
            b = {**body, "prediction": {"type": "content", "content": guess}, "stream": stream,
                 **({"stream_options": {"include_usage": True, "include_obfuscation": True}} if stream else {})}
            r = post(s.url + "/v1/chat/completions", json=b)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
                got = "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"])
                u = events[-1]["usage"]
                assert all("obfuscation" in e for e in events)
            else:
                got, u = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
            assert got == text, (guess, stream)
            d = u["completion_tokens_details"]
            assert (d["accepted_prediction_tokens"] >= 10) == good, (guess, d)


def test_obfuscation_is_off_unless_asked(serve):
    s = serve()
    r = post(s.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and "obfuscation" not in r.text
