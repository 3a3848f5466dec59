"""The official `tinker` SDK against `temper api serve` on a fixture model.

Run: python tests/python/test_training_api.py [--temper target/release/temper]
Needs `pip install tinker` (see .ci/run). Starts the server on a free
loopback port, drives it through the SDK, and prints `tinker-sdk: N passed,
M failed`; exits non-zero on any failure.
"""

import argparse
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "fixtures", "models", "tiny-qwen3")
ADAPTER_DIR = os.path.join(ROOT, "fixtures", "adapters", "tiny-qwen3-lora")
API_KEY = "tml-local-test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, port, ckpt_dir):
    proc = subprocess.Popen(
        [binary, "api", "serve", "--model", f"tiny={MODEL_DIR}", "--host", "127.0.0.1",
         "--port", str(port), "--api-key", API_KEY, "--checkpoints", ckpt_dir,
         "--adapter", f"peft={ADAPTER_DIR}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/healthz",
                                         headers={"X-API-Key": API_KEY})
            urllib.request.urlopen(req, timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "release", "temper"))
    args = ap.parse_args()
    port = free_port()
    ckpt = tempfile.mkdtemp(prefix="temper-api-test-")
    os.environ.update({
        "TINKER_BASE_URL": f"http://127.0.0.1:{port}",
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
    })
    warnings.simplefilter("ignore")
    import tinker
    from tinker import types

    server = start_server(args.temper, port, ckpt)
    results = []
    state = {}

    def check(name):
        def wrap(fn):
            t0 = time.time()
            try:
                fn()
                results.append((name, True))
                print(f"ok   {name} ({time.time() - t0:.2f}s)")
            except Exception:
                results.append((name, False))
                print(f"FAIL {name}")
                traceback.print_exc()
            return fn
        return wrap

    sc = tinker.ServiceClient()
    tokens = list(range(40, 72))  # a fixed 32-token sequence
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})

    @check("capabilities list the served model")
    def _():
        caps = sc.get_server_capabilities()
        names = [m.model_name for m in caps.supported_models]
        assert names == ["tiny"], names

    @check("create a LoRA training client")
    def _():
        tc = sc.create_lora_training_client(base_model="tiny", rank=8)
        tc = tc.result() if hasattr(tc, "result") else tc
        info = tc.get_info()
        assert info.model_data.model_name == "tiny", info
        state["tc"] = tc

    @check("forward_backward + optim_step drive the loss down")
    def _():
        tc = state["tc"]
        losses = []
        for _ in range(6):
            fb = tc.forward_backward([datum], "cross_entropy")
            op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
            out = fb.result()
            op.result()
            losses.append(out.metrics["loss:sum"])
            lp = out.loss_fn_outputs[0]["logprobs"].tolist()
            assert len(lp) == len(tokens) - 1
        print("     losses:", [round(x, 3) for x in losses])
        assert all(b < a for a, b in zip(losses, losses[1:])), losses

    @check("sampler logprobs equal compute_logprobs (zero mismatch over HTTP)")
    def _():
        tc = state["tc"]
        smp = tc.save_weights_and_get_sampling_client()
        smp = smp.result() if hasattr(smp, "result") else smp
        prompt = tokens[:8]
        res = smp.sample(types.ModelInput.from_ints(prompt), 2,
                         types.SamplingParams(max_tokens=6, seed=5, temperature=1.0, stop=[])).result()
        assert len(res.sequences) == 2
        for seq in res.sequences:
            assert len(seq.tokens) == 6 and len(seq.logprobs) == 6, seq
            lp = smp.compute_logprobs(types.ModelInput.from_ints(prompt + list(seq.tokens))).result()
            assert lp[0] is None
            assert lp[len(prompt):] == list(seq.logprobs), (lp[len(prompt):], seq.logprobs)
        again = smp.sample(types.ModelInput.from_ints(prompt), 2,
                           types.SamplingParams(max_tokens=6, seed=5, temperature=1.0, stop=[])).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
        state["smp"] = smp

    @check("forward logprobs match the sampler's weights")
    def _():
        tc = state["tc"]
        out = tc.forward([datum], "cross_entropy").result()
        lp = state["smp"].compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        fwd = out.loss_fn_outputs[0]["logprobs"].tolist()
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=0) for a, b in zip(fwd, lp[1:])), (fwd[:4], lp[1:5])

    @check("save_state and load_state round-trip")
    def _():
        tc = state["tc"]
        path = tc.save_state("ckpt-a").result().path
        assert path.startswith("tinker://") and path.endswith("/weights/ckpt-a"), path
        before = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        moved = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert moved != before
        tc.load_state(path).result()
        after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert after == before, (before, after)

    @check("create_training_client_from_state resumes a checkpoint")
    def _():
        tc = state["tc"]
        path = tc.save_state("ckpt-b").result().path
        want = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc2 = sc.create_training_client_from_state_with_optimizer(path)
        tc2 = tc2.result() if hasattr(tc2, "result") else tc2
        assert tc2.model_id != tc.model_id
        got = tc2.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert got == want, (want, got)
        tc2.forward_backward([datum], "cross_entropy").result()
        tc2.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    @check("create_training_client_from_state starts from a served PEFT adapter")
    def _():
        tc = sc.create_training_client_from_state("tinker://adapters/peft/peft")
        tc = tc.result() if hasattr(tc, "result") else tc
        assert tc.get_info().lora_rank == 4, tc.get_info()
        base = sc.create_lora_training_client(base_model="tiny", rank=4)
        with_adapter = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        without = base.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert with_adapter != without, (with_adapter, without)
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert after < with_adapter, (with_adapter, after)

    @check("a bad request fails its future and the client keeps working")
    def _():
        tc = state["tc"]
        bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 999999]),
                          loss_fn_inputs={"target_tokens": [2, 3, 4]})
        try:
            tc.forward_backward([bad], "cross_entropy").result()
            raise AssertionError("expected a failure")
        except tinker.RequestFailedError as e:
            assert "out of range" in str(e), e
        try:
            tc.forward_backward([datum], "importance_sampling").result()
            raise AssertionError("expected a failure")
        except tinker.RequestFailedError as e:
            assert "logprobs" in str(e), e
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    @check("gspo, as tinker-cookbook's rl_loop sends it, matches its definition")
    def _():
        tc = state["tc"]
        n, ob = len(tokens) - 1, 5
        p = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        # Off-policy sampler logprobs; prompt positions carry no advantage and
        # stay outside the sequence ratio, as rl_loop builds them.
        q = [0.0] * ob + [p[i] + (0.3 if i % 2 else -0.2) for i in range(ob, n)]
        mask = [0.0] * ob + [1.0] * (n - ob)

        def gspo_datum(a):
            adv = [0.0] * ob + [a] * (n - ob)
            return adv, types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": q,
                                "advantages": adv, "sequence_ratio_mask": mask})

        # The sequence ratio is about 0.95: inside the default clip, and below
        # the tight one, where a negative advantage takes the clipped term.
        for lo, hi, a in [(0.8, 1.2, 0.7), (0.99, 1.01, -0.7)]:
            adv, d = gspo_datum(a)
            cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi}
            out = tc.forward([d], "gspo", loss_fn_config=cfg).result()
            p2 = out.loss_fn_outputs[0]["logprobs"].tolist()
            s = math.exp(sum(p2[i] - q[i] for i in range(ob, n)) / (n - ob))
            want = -sum(min(s * a, min(max(s, lo), hi) * a) for a in adv)
            got = out.metrics["loss:sum"]
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (lo, hi, got, want)
        tc.forward_backward([d], "gspo").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    @check("what temper cannot honour is refused by name, never ignored")
    def _():
        tc = state["tc"]
        ok = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:],
                                         "logprobs": [-1.0] * (len(tokens) - 1),
                                         "advantages": [1.0] * (len(tokens) - 1)})

        def refused(call, *words):
            try:
                call()
            except Exception as e:  # a failed future or a 400, by the SDK's path
                assert all(w in str(e) for w in words), (words, e)
                return
            raise AssertionError(f"expected a refusal naming {words}")

        refused(lambda: tc.forward_backward([ok], "stable_reinforce").result(),
                "stable_reinforce", "not supported")
        refused(lambda: tc.forward_backward([ok], "gspo").result(), "sequence_ratio_mask")
        refused(lambda: tc.forward_backward([ok], "ppo", loss_fn_config={"kl_coeff": 0.1}).result(),
                "kl_coeff")
        smp = tc.save_weights_and_get_sampling_client(record_stability_info=True)
        smp = smp.result() if hasattr(smp, "result") else smp
        refused(lambda: smp.sample(types.ModelInput.from_ints(tokens[:8]), 1,
                                   types.SamplingParams(max_tokens=2)).result(),
                "record_stability_info")
        tc.forward_backward([ok], "ppo").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    @check("get_tokenizer loads the model's own tokenizer offline")
    def _():
        tok = state["tc"].get_tokenizer()
        ids = tok.encode("What is 12 + 7?", add_special_tokens=False)
        assert len(ids) > 0

    @check("kill -9, restart: a checkpoint resumes with its optimizer and identical next losses")
    def _():
        # Issue 13 items 4-5: the run registry and ids survive a crash.
        nonlocal server, sc
        tc = sc.create_lora_training_client(base_model="tiny", rank=4)
        tc = tc.result() if hasattr(tc, "result") else tc
        lr = types.AdamParams(learning_rate=1e-2)

        def train_and_measure(client, steps):
            losses = []
            for _ in range(steps):
                fb = client.forward_backward([datum], "cross_entropy")
                client.optim_step(lr).result()
                losses.append(fb.result().metrics["loss:sum"])
            return losses

        train_and_measure(tc, 2)
        path = tc.save_state("before-crash").result().path
        want = train_and_measure(tc, 3)
        server.kill()  # SIGKILL: nothing is flushed on the way out
        server.wait(timeout=10)
        server = start_server(args.temper, port, ckpt)
        sc = tinker.ServiceClient()
        tc2 = sc.create_training_client_from_state_with_optimizer(path)
        tc2 = tc2.result() if hasattr(tc2, "result") else tc2
        got = train_and_measure(tc2, 3)
        assert got == want, (want, got)
        # A new client's save under the same name is a new checkpoint; the
        # pre-crash one is untouched.
        tc3 = sc.create_lora_training_client(base_model="tiny", rank=4)
        tc3 = tc3.result() if hasattr(tc3, "result") else tc3
        path3 = tc3.save_state("before-crash").result().path
        assert path3 != path, (path3, path)
        tc4 = sc.create_training_client_from_state_with_optimizer(path)
        tc4 = tc4.result() if hasattr(tc4, "result") else tc4
        assert train_and_measure(tc4, 3) == want

    @check("a wrong API key is rejected")
    def _():
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/healthz",
                                     headers={"X-API-Key": "tml-wrong"})
        try:
            urllib.request.urlopen(req, timeout=5)
            raise AssertionError("expected 401")
        except urllib.error.HTTPError as e:
            assert e.code == 401, e.code

    try:
        sc.close("success")
    except Exception:
        pass
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    passed = sum(ok for _, ok in results)
    failed = len(results) - passed
    print(f"tinker-sdk: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
