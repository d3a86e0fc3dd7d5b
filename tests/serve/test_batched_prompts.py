"""Several prompts in one completions request (OpenAI's `prompt` as a list of texts or of token-id
lists): n choices per prompt, numbered on across prompts, each exactly what the prompt gets alone.
lm-evaluation-harness's `local-completions` sends this by default (tokenized_requests=True:
`prompt: [[ids...]]`, echo, logprobs 1, max_tokens 1 for loglikelihood)."""
import httpx

from exactspec.serve.options import ServeOptions
from tests.serve.serving import openai_client


def _post(s, **body):
    return httpx.post(s.url + "/v1/completions", json=dict(model="tiny", **body), timeout=60)


def test_lm_eval_harness_loglikelihood_payload(serve, model):
    s = serve()
    ids = [model.encode("def add(a, b):"), model.encode("import os"), model.encode("x = [1, 2, 3]")]
    got = _post(s, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0.0)
    assert got.status_code == 200, got.text
    body = got.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, p in enumerate(ids):
        alone = _post(s, prompt=p, echo=True, logprobs=1, max_tokens=1, temperature=0.0).json()
        assert body["choices"][i]["text"] == alone["choices"][0]["text"]
        assert body["choices"][i]["logprobs"] == alone["choices"][0]["logprobs"]
        want = [x.logprob for x in model.score(p[:1], p[1:])]
        assert body["choices"][i]["logprobs"]["token_logprobs"][1:len(p)] == want
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids)) and body["usage"]["completion_tokens"] == 3


def test_text_prompts_with_n_and_the_openai_client(serve):
    s = serve()
    c = openai_client(s)
    prompts = ["def f(x):", "class A:"]
    r = c.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = c.completions.create(model="tiny", prompt=p, n=2, max_tokens=6, temperature=0.9, seed=3)
        assert [ch.text for ch in r.choices[2 * i:2 * i + 2]] == [ch.text for ch in alone.choices]


def test_batched_prompt_errors(serve):
    s = serve(ServeOptions(max_prompts=2))
    for body, field in [(dict(prompt=["a", "b"], stream=True), "stream"), (dict(prompt=["a", "b", "c"]), "prompt"),
                        (dict(prompt=[[1, 2], [3, True]]), "prompt"), (dict(prompt=[1, "a"]), "prompt"),
                        (dict(prompt=[[1, 2], [10 ** 9]]), "prompt")]:
        r = _post(s, max_tokens=2, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"].startswith(field), (body, r.json())
