"""The gRPC API without Ray: the committed generated code is current, requests become the HTTP
API's bodies (same defaults, same validation), and failures map onto one status per transport."""

import grpc
import pytest
from pydantic import ValidationError

from specserve.client import chat_request, generate_request
from specserve.grpc import specserve_pb2 as pb
from specserve.protocol import SamplingParams, SpecserveError
from specserve.serve.generation import ModelNotFound, NotReady, OutputCursor, TextStream, failure
from specserve.serve.grpc_api import chat_body, completion_body, usage_message
from specserve.serve.openai_api import CompletionRequest


def test_the_committed_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    from specserve.grpc.codegen import PACKAGE_ROOT, generate

    for name, text in generate(tmp_path).items():
        assert (PACKAGE_ROOT / name).read_text() == text, f"{name} is stale: run python -m specserve.grpc.codegen"


def test_a_grpc_request_becomes_the_http_body():
    request = generate_request("smol", "Hi", {"proposer": "draft", "shape": "tree",
                                              "tree": {"budget": 4, "shape": [[0], [1]]}},
                               max_tokens=8, temperature=0, stop="\n")
    body = completion_body(request)
    expected = CompletionRequest.model_validate({
        "model": "smol", "prompt": "Hi", "max_tokens": 8, "temperature": 0, "stop": ["\n"],
        "speculation": {"proposer": "draft", "shape": "tree", "tree": {"budget": 4, "shape": [[0], [1]]}}})
    assert body == expected
    assert completion_body(generate_request("smol", [5, 6])) == CompletionRequest(model="smol", prompt=[5, 6])
    adaptive = completion_body(generate_request("smol", "Hi", {"k": 4, "policy": "adaptive", "solo_k": 8, "pipeline": 0}))
    assert adaptive.speculation.model_dump(exclude_none=True) == {"k": 4, "policy": "adaptive", "solo_k": 8,
                                                                   "pipeline": 0}
    reranked = completion_body(generate_request("smol", "Hi", {"shape": "tree", "tree": {"budget": 8, "rerank": True}}))
    assert reranked.speculation.tree.model_dump(exclude_unset=True) == {"budget": 8, "rerank": True}
    chat = chat_body(chat_request("smol", [{"role": "user", "content": "Hi"}], top_k=3))
    assert chat.template_messages() == [{"role": "user", "content": "Hi"}] and chat.top_k == 3


def test_bad_grpc_input_fails_as_http_validation_does():
    with pytest.raises(ValidationError) as err:
        completion_body(generate_request("smol", "x", max_tokens=-1))
    f = failure(err.value)
    assert (f.http_status, f.grpc_code) == (400, "INVALID_ARGUMENT") and f.message.startswith("max_tokens:")


@pytest.mark.parametrize("exc,http,code", [
    (SpecserveError("bad"), 400, "INVALID_ARGUMENT"),
    (ModelNotFound("nope"), 404, "NOT_FOUND"),
    (NotReady("starting"), 503, "UNAVAILABLE"),
])
def test_failures_map_to_one_status_per_transport(exc, http, code):
    f = failure(exc)
    assert (f.http_status, f.grpc_code, f.message) == (http, code, str(exc))
    assert failure(RuntimeError("boom")) is None  # a server error: HTTP 500, gRPC INTERNAL


def test_usage_carries_the_speculation_stats():
    stats = {"proposer": "draft", "shape": "chain", "num_drafts": 2, "num_draft_tokens": 6,
             "num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [2, 1, 1], "k_histogram": {"3": 2},
             "acceptance_rate": 0.6667, "lossy": False}
    message = usage_message({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9, "speculation": stats})
    assert message.speculation.num_accepted_tokens == 4 and list(message.speculation.num_accepted_tokens_per_pos) == [2, 1, 1]
    assert dict(message.speculation.k_histogram) == {3: 2} and message.total_tokens == 9


def test_the_cursor_sends_each_id_once_and_holds_back_a_possible_stop():
    cursor = OutputCursor(TextStream(("STOP",)))
    assert cursor.advance([1, 2], "Hello ST", final=False) == ([1, 2], "Hello")
    assert cursor.advance([1, 2, 3], "Hello there", final=True) == ([3], " there")


def test_a_resumed_request_state_starts_after_the_tokens_it_was_given():
    from specserve.protocol import Speculation
    from specserve.request_state import RequestState

    def state(max_tokens=10, **params):
        return RequestState("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, **params), Speculation(),
                            frozenset({0}))

    def decode(ids):
        return "".join(chr(96 + t) for t in ids)  # 1 -> "a", 2 -> "b", ...

    s = state()
    s.resume([5, 6], decode)
    assert s.output_ids == [5, 6] and s.token_ids == [1, 2, 3, 5, 6] and not s.finished and s.room() == 8
    s = state(max_tokens=2)
    s.resume([5, 6], decode)
    assert s.finish_reason == "length"
    s = state()
    s.resume([5, 0], decode)  # EOS: the interrupted stream had ended
    assert s.finish_reason == "stop"
    with pytest.raises(SpecserveError, match="go on after the generation ended at token 2"):
        state().resume([5, 0, 7], decode)
    s = state(stop=("fg",))
    s.resume([5, 6, 7, 8], decode)  # "efgh": the stop string ends it at "e"
    assert s.finish_reason == "stop" and s.stop_text == "e" and s.output_ids == [5, 6, 7]


class _Broken(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_a_resuming_stream_sends_the_request_again_with_what_it_received():
    """The client side of a lost router: the first call breaks after two deltas (UNAVAILABLE),
    the second is sent with their token ids and finishes; the caller sees one stream."""
    from specserve.client import ResumingStream

    sent = []

    def start(request):
        sent.append(list(request.resume_token_ids))

        def call():
            if len(sent) == 1:
                yield pb.GenerateResponse(text="a", token_ids=[1])
                yield pb.GenerateResponse(text="b", token_ids=[2])
                raise _Broken(grpc.StatusCode.UNAVAILABLE)
            yield pb.GenerateResponse(text="c", token_ids=[3], finish_reason="length")
        return call()

    stream = ResumingStream(start, generate_request("m", "hi", max_tokens=3), resumes=2, wait_s=0)
    assert "".join(m.text for m in stream) == "abc" and sent == [[], [1, 2]] and stream.resumed == 1

    def refusing(request):
        raise _Broken(grpc.StatusCode.INVALID_ARGUMENT)
        yield  # a generator, like a call

    with pytest.raises(grpc.RpcError):  # a refusal is never resumed
        list(ResumingStream(refusing, generate_request("m", "hi"), resumes=2, wait_s=0))
