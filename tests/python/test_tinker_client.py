"""temper as a Tinker client: every request on the wire checked by the SDK.

Run: python tests/python/test_tinker_client.py [--temper target/debug/temper]
Needs `pip install -r tests/python/requirements.txt` (the tinker SDK).

Starts `temper api serve` on a fixture model and, in front of it, a recording
proxy that plays a hosted Tinker service: it validates every request body
against the SDK's own request types (`tinker.types.*`, which forbid unknown
fields; `forward_backward`'s protobuf is decoded with the SDK's schema and
must equal what the SDK's encoder writes for the same data), checks the
SDK's auth header, `Content-Type`, and the future-polling headers (`Accept:
application/x-protobuf` on protobuf results, `X-Tinker-Request-Type`), and
answers the way a busy service does, all of which the SDK handles: a
`try_again` and an HTTP 408 before each result, a 503 on a poll, a 503 on a
training submit and a 429 on a sampling submit (both to be resubmitted with
the same `seq_id`), and one result held back 11 s (the client must keep its
session alive with heartbeats meanwhile).

First the SDK itself goes through the proxy (the control: the checks accept
what the SDK sends, and the faults are ones it survives); then `temper train
rl` and `temper train sft` with `[remote_trainer] url` pointing at the proxy.
Prints `tinker-client: N passed, M failed`; exits non-zero on a failure.
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import typing
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graded_env import write_graded_env  # noqa: E402
from test_training_api import API_KEY, MODEL_DIR, free_port, start_server  # noqa: E402

warnings.simplefilter("ignore")
os.environ.update({"TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"})

import numpy as np  # noqa: E402  (a dependency of tinker)
from google.protobuf.unknown_fields import UnknownFieldSet  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# Route → the SDK's request type for its JSON body.
JSON_REQUESTS = {
    "client/config": types.ClientConfigRequest,
    "create_session": types.CreateSessionRequest,
    "session_heartbeat": types.SessionHeartbeatRequest,
    "create_model": types.CreateModelRequest,
    "get_info": types.GetInfoRequest,
    "optim_step": types.OptimStepRequest,
    "save_weights": types.SaveWeightsRequest,
    "save_weights_for_sampler": types.SaveWeightsForSamplerRequest,
    "load_weights": types.LoadWeightsRequest,
    "create_sampling_session": types.CreateSamplingSessionRequest,
    "asample": types.SampleRequest,
    "retrieve_future": types.FutureRetrieveRequest,
}
# Routes whose answer is a future, and the X-Tinker-Request-Type of its polls.
FUTURE_TYPES = {
    "create_model": "CreateModel",
    "optim_step": "OptimStep",
    "save_weights": "SaveWeights",
    "save_weights_for_sampler": "SaveWeightsForSampler",
    "load_weights": "LoadWeights",
    "asample": "Sample",
}
PROTO_RESULTS = {"Forward", "ForwardBackward", "Sample"}
DTYPES = {pb.DTYPE_INT64: np.int64, pb.DTYPE_FLOAT32: np.float32}
DTYPE_NAMES = {pb.DTYPE_INT64: "int64", pb.DTYPE_FLOAT32: "float32"}


def check_forward_backward(body):
    """The protobuf body, decoded with the SDK's schema and re-encoded by the
    SDK's own encoder from the same data; returns (problems, request type)."""
    msg = pb.ForwardBackwardRequest.FromString(body)
    problems = []
    if len(UnknownFieldSet(msg)):
        problems.append("forward_backward: fields unknown to the SDK's schema")
    if msg.loss_fn not in typing.get_args(types.LossFnType):
        problems.append(f"forward_backward: loss_fn {msg.loss_fn!r} is not a tinker LossFnType")
    data = []
    for d in msg.data:
        chunks = []
        for c in d.model_input:
            if c.WhichOneof("chunk") != "encoded_text":
                problems.append(f"forward_backward: chunk {c.WhichOneof('chunk')}")
                continue
            chunks.append(types.EncodedTextChunk(
                tokens=np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist()))
        inputs = {}
        for k, t in d.loss_fn_inputs.items():
            if t.WhichOneof("encoding") != "dense" or t.dtype not in DTYPES:
                problems.append(f"forward_backward: {k} is not a dense int64/float32 tensor")
                continue
            arr = np.frombuffer(t.dense, dtype=DTYPES[t.dtype]).reshape(list(t.shape))
            inputs[k] = types.TensorData.from_numpy(arr)
        data.append(types.Datum(model_input=types.ModelInput(chunks=chunks),
                                loss_fn_inputs=inputs))
    config = dict(msg.loss_fn_config) or None
    sdk = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=msg.loss_fn, loss_fn_config=config),
        model_id=msg.model_id, seq_id=msg.seq_id))
    sdk.forward_only = msg.forward_only
    if sdk != msg:
        problems.append("forward_backward: differs from the SDK's encoding of the same request")
    if msg.seq_id < 1:
        problems.append("forward_backward: seq_id < 1")
    return (problems, ("Forward" if msg.forward_only else "ForwardBackward"), msg.model_id,
            msg.seq_id, len(msg.data))


class Service:
    """The recording, checking, fault-injecting proxy."""

    def __init__(self, upstream_port, hold_s, flags=None, jwt=False):
        self.upstream = upstream_port
        self.hold_s = hold_s
        self.flags = flags or {}    # merged into the service's client/config
        self.jwt = jwt              # ask for the key to be exchanged for JWTs
        self.tokens = []            # JWTs issued; the first is revoked mid-run
        self.revoked = None
        self.fb_datums = []         # datums per forward_backward request
        self.lock = threading.Lock()
        self.problems = []          # every divergence from the SDK, with its route
        self.routes = []            # every route, in order
        self.futures = {}           # request_id → expected request type
        self.polls = {}             # request_id → polls seen
        self.faults = {}            # fault name → times injected
        self.resubmits = {}         # (route, owner, seq_id) → body of the first submit
        self.same_resubmits = 0
        self.held = False
        self.heartbeats_while_held = 0
        self.holding = False

    def problem(self, route, what):
        with self.lock:
            self.problems.append(f"{route}: {what}")

    def fault(self, name):
        with self.lock:
            self.faults[name] = self.faults.get(name, 0) + 1

    def start(self):
        svc = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                svc.handle(self, None)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                svc.handle(self, self.rfile.read(n))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def reply(self, h, status, body, ctype="application/json", extra=()):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        for k, v in extra:
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def handle(self, h, body):
        path = h.path.split("?")[0]
        route = path.removeprefix("/api/v1/")
        with self.lock:
            self.routes.append(route)
        key = h.headers.get("X-API-Key")
        if route == "auth/token":
            # The JWT exchange: the key buys a token, sent in its place after.
            if key != API_KEY:
                self.problem(route, f"X-API-Key is {key!r}")
            with self.lock:
                self.tokens.append(f"eyJ.test-token.{len(self.tokens)}")
                tok = self.tokens[-1]
            return self.reply(h, 200, {"jwt": tok})
        if self.jwt and route != "client/config":
            if key == self.revoked:
                return self.reply(h, 401, {"detail": "token expired"})
            if key not in self.tokens:
                self.problem(route, f"X-API-Key is {key!r}, not an issued JWT")
            elif route == "optim_step" and self.revoked is None:
                # The token expires mid-run: the client must exchange again.
                self.revoked = key
                self.fault("401 jwt")
                return self.reply(h, 401, {"detail": "token expired"})
        elif key != API_KEY:
            self.problem(route, f"X-API-Key is {key!r}")
        if h.headers.get("Authorization"):
            self.problem(route, "an Authorization header (the SDK sends only X-API-Key)")
        owner = seq = None
        if body is not None:
            ctype = h.headers.get("Content-Type", "")
            if route == "forward_backward":
                if "application/x-protobuf" not in ctype:
                    self.problem(route, f"Content-Type {ctype!r}")
                try:
                    probs, kind, owner, seq, n = check_forward_backward(body)
                    with self.lock:
                        self.fb_datums.append(n)
                    for p in probs:
                        self.problem(route, p)
                except Exception as e:  # a body the SDK's schema cannot parse
                    self.problem(route, f"undecodable protobuf: {e}")
                    kind = None
            else:
                if "application/json" not in ctype:
                    self.problem(route, f"Content-Type {ctype!r}")
                kind = FUTURE_TYPES.get(route)
                try:
                    obj = json.loads(body)
                except ValueError:
                    self.problem(route, "body is not JSON")
                    obj = {}
                cls = JSON_REQUESTS.get(route)
                if cls is not None:
                    try:
                        cls.model_validate(obj)
                    except Exception as e:
                        self.problem(route, f"{cls.__name__} rejects {obj}: {e}")
                elif not route.startswith(("sessions/", "telemetry", "client/dynamic_config")):
                    self.problem(route, "a route the SDK does not have")
                owner = obj.get("model_id") or obj.get("sampling_session_id")
                seq = obj.get("seq_id")
                if route == "asample" and h.headers.get("X-Tinker-Sampling-Backpressure") != "1":
                    self.problem(route, "no X-Tinker-Sampling-Backpressure: 1")
                if route == "retrieve_future":
                    return self.poll(h, body, obj)
                if route == "session_heartbeat" and self.holding:
                    with self.lock:
                        self.heartbeats_while_held += 1
            # A busy service refuses the first training and sampling submits:
            # the client must resubmit the same body (same seq_id).
            if seq is not None:
                key = (route, owner, seq)
                with self.lock:
                    first = self.resubmits.get(key)
                    if first is None:
                        self.resubmits[key] = body
                    elif first == body:
                        self.same_resubmits += 1
                    else:
                        self.problems.append(f"{route}: resubmit of seq_id {seq} changed its body")
                if first is None and route == "optim_step" and not self.faults.get("503 submit"):
                    self.fault("503 submit")
                    return self.reply(h, 503, {"detail": "overloaded, retry"})
                if first is None and route == "asample" and not self.faults.get("429 submit"):
                    self.fault("429 submit")
                    return self.reply(h, 429, {"detail": "sampling backpressure"})
        status, rbody, rtype = self.forward(h, body)
        if route == "client/config" and status == 200:
            cfg = dict(json.loads(rbody), **self.flags)
            if self.jwt:
                cfg["pjwt_auth_enabled"] = True
            rbody = json.dumps(cfg).encode()
        if kind and status == 200:
            try:
                rid = json.loads(rbody)["request_id"]
                with self.lock:
                    self.futures[rid] = kind
            except (ValueError, KeyError):
                self.problem(route, "submit answered without a request_id")
        self.reply(h, status, rbody, rtype)

    def forward(self, h, body):
        c = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=120)
        headers = {k: v for k, v in h.headers.items()
                   if k.lower() not in ("host", "content-length", "connection", "x-api-key")}
        headers["X-API-Key"] = API_KEY  # upstream knows the key, not the JWTs
        c.request(h.command, h.path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, r.getheader("Content-Type", "application/json")

    def poll(self, h, body, obj):
        rid = obj.get("request_id")
        with self.lock:
            kind = self.futures.get(rid)
            n = self.polls.get(rid, 0)
            self.polls[rid] = n + 1
        if kind is None:
            self.problem("retrieve_future", f"polls {rid!r}, which no submit returned")
        else:
            want = h.headers.get("X-Tinker-Request-Type")
            if want != kind:
                self.problem("retrieve_future", f"X-Tinker-Request-Type {want!r} for a {kind}")
            proto = "application/x-protobuf" in h.headers.get("Accept", "")
            if proto != (kind in PROTO_RESULTS):
                self.problem("retrieve_future",
                             f"Accept {h.headers.get('Accept')!r} for a {kind} result")
        # Pending first (as a try_again, then as a 408), a 503 on the third poll of a step.
        if n == 0:
            self.fault("try_again")
            return self.reply(h, 200, {"type": "try_again", "request_id": rid,
                                       "queue_state": "paused_capacity",
                                       "queue_state_reason": "test"})
        if n == 1:
            self.fault("408")
            return self.reply(h, 408, {"queue_state": "active"})
        if n == 2 and kind == "OptimStep" and not self.faults.get("503 poll"):
            self.fault("503 poll")
            return self.reply(h, 503, {"detail": "try later"})
        if kind == "OptimStep" and not self.held:
            # One result held back past the heartbeat period.
            self.held = self.holding = True
            self.fault("held")
            time.sleep(self.hold_s)
            self.holding = False
        status, rbody, rtype = self.forward(h, body)
        self.reply(h, status, rbody, rtype)


def sdk_control(url):
    """The SDK's own loop through the service: the checks must pass it."""
    import tinker
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1)
    toks = list(range(40, 56))
    datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 15})
    fb = tc.forward_backward([datum], "cross_entropy")
    op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    loss = fb.result().metrics["loss:sum"]
    op.result()
    tc.forward([datum], "cross_entropy").result()
    path = tc.save_state("c1").result().path
    tc.load_state(path).result()
    smp = tc.save_weights_and_get_sampling_client()
    out = smp.sample(types.ModelInput.from_ints(toks[:4]), 2,
                     types.SamplingParams(max_tokens=4, seed=3)).result()
    assert len(out.sequences) == 2
    smp.compute_logprobs(types.ModelInput.from_ints(toks[:6])).result()
    return loss


def rl_config(d, url, run):
    path = os.path.join(d, "rl.toml")
    with open(path, "w") as f:
        f.write(f"""seed = 5
[model]
path = "{MODEL_DIR}"
[lora]
rank = 4
alpha = 32.0
[[env]]
id = "{write_graded_env(d, 16)}"
[sampling]
max_tokens = 6
group_size = 2
temperature = 1.0
[trainer]
lr = 1e-2
batch_size = 2
max_steps = 2
[async]
max_off_policy_steps = 0
[eval]
num_examples = 0
[ckpt]
interval = 1
[log]
dir = "{run}"
progress = false
[remote_trainer]
url = "{url}"
base_model = "tiny"
api_key_env = "TINKER_API_KEY"
""")
    return path


def sft_config(d, url, run):
    data = os.path.join(d, "chat.jsonl")
    with open(data, "w") as f:
        for c in ["red", "blue", "green", "black"]:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"color {c}?"},
                {"role": "assistant", "content": f"<c>{c}</c>"}]}) + "\n")
    path = os.path.join(d, "sft.toml")
    with open(path, "w") as f:
        f.write(f"""seed = 4
[model]
path = "{MODEL_DIR}"
[lora]
rank = 4
alpha = 32.0
[data]
path = "{data}"
[trainer]
lr = 1e-2
batch_size = 2
max_steps = 2
[ckpt]
interval = 2
[log]
dir = "{run}"
progress = false
[remote_trainer]
url = "{url}"
base_model = "tiny"
api_key_env = "TINKER_API_KEY"
""")
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default="target/debug/temper")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="temper-tinker-client-")
    port = free_port()
    server = start_server(args.temper, port, os.path.join(d, "ckpt"))
    results = []

    def check(name, ok, detail=""):
        results.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))

    try:
        # The control: the SDK through the same checks and faults.
        sdk = Service(port, hold_s=0)
        url = sdk.start()
        t0 = time.time()
        loss = sdk_control(url)
        check(f"the SDK's own requests pass the checks ({time.time() - t0:.1f}s, loss {loss:.3f})",
              not sdk.problems, "; ".join(sdk.problems[:5]))
        check("the SDK survives every injected fault",
              {"try_again", "408", "503 poll", "503 submit", "429 submit"} <= sdk.faults.keys(),
              str(sdk.faults))

        # temper train rl, then sft, with [remote_trainer] url = the service.
        svc = Service(port, hold_s=11, flags={"fwdbwd_max_chunk_len": 1}, jwt=True)
        url = svc.start()
        env = dict(os.environ, TINKER_API_KEY=API_KEY)
        for what, cfg in [("rl", rl_config(d, url, os.path.join(d, "rl"))),
                          ("sft", sft_config(d, url, os.path.join(d, "sft")))]:
            t0 = time.time()
            p = subprocess.run([args.temper, "--threads", "1", "train", what, cfg], env=env,
                               capture_output=True, text=True, timeout=300)
            check(f"temper train {what} through the service ({time.time() - t0:.1f}s)",
                  p.returncode == 0, (p.stdout + p.stderr)[-2000:])
            run = os.path.join(d, what)
            if p.returncode == 0:
                rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
                check(f"  its {len(rows)} steps logged", len(rows) == 2)
            if what == "rl":
                # Resume from the service's checkpoint (load_weights).
                p = subprocess.run([args.temper, "--threads", "1", "train", "rl", cfg,
                                    "--resume", run, "--trainer.max_steps", "3"], env=env,
                                   capture_output=True, text=True, timeout=300)
                rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
                check("  --resume continues on the service's checkpoint",
                      p.returncode == 0 and [r["step"] for r in rows] == [1, 2, 3],
                      (p.stdout + p.stderr)[-2000:])
        print("     routes:", sorted(set(svc.routes)))
        check("every request temper sends validates against the SDK's types and headers",
              not svc.problems, "; ".join(dict.fromkeys(svc.problems)))
        check("temper's client survives every injected fault",
              {"try_again", "408", "503 poll", "503 submit", "429 submit", "held"}
              <= svc.faults.keys(), str(svc.faults))
        check("a refused submit is resubmitted unchanged (same seq_id)",
              svc.same_resubmits >= 2, f"{svc.same_resubmits} resubmits")
        fbs = len(svc.fb_datums)
        steps = svc.routes.count("optim_step") - svc.faults.get("503 submit", 0)
        check("forward_backward is split as the service's client/config says (1 datum each)",
              fbs > steps and max(svc.fb_datums) == 1, f"{fbs} requests, {steps} steps")
        check("the key is exchanged for a JWT, and again when the service rejects it",
              svc.faults.get("401 jwt") == 1 and len(svc.tokens) >= 4, f"{len(svc.tokens)} JWTs")
        check("heartbeats keep the session alive while a result is held",
              svc.heartbeats_while_held >= 1, f"{svc.heartbeats_while_held} heartbeats")
        want = {"create_session", "create_model", "forward_backward", "optim_step",
                "save_weights_for_sampler", "asample", "save_weights", "load_weights",
                "retrieve_future", "session_heartbeat", "auth/token"}
        check("the RL and SFT loops use the whole protocol",
              want <= set(svc.routes), str(want - set(svc.routes)))
    finally:
        server.kill()
    failed = results.count(False)
    print(f"tinker-client: {len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
