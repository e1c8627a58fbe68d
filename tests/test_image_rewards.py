import base64
import io
import json
import string
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from local_server import LocalServer
from PIL import Image
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

from diffusion_rl.reward_server import DEFAULT_REWARD_SERVER_URL, RewardServerError
from diffusion_rl.rewards import CLIP_MEAN, CLIP_STD, AestheticHead, as_image_list, clip_preprocess
from mmrl.registry import REWARDS

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "car", "on", "the", "grass"]
PROMPTS = ["a photo of a cat", "a red car", "a blue dog on the grass"]


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer over single letters plus a few whole words, built from a vocab
    and merges written here (no download)."""
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for letter in string.ascii_lowercase:
        vocab.setdefault(letter, len(vocab))
        vocab.setdefault(letter + "</w>", len(vocab))
    for word in WORDS:
        symbols = [*word[:-1], word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            symbols = [pair[0] + pair[1], *symbols[2:]]
    # special tokens last, as in OpenAI CLIP (an eos id of 2 would select CLIP's legacy pooling)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random CLIPModel and its tokenizer, saved with save_pretrained."""
    torch.manual_seed(0)
    tokenizer = tiny_clip_tokenizer()
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={
            **layers,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 16,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**layers, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip_model(clip_dir: Path) -> CLIPModel:
    return CLIPModel.from_pretrained(clip_dir, use_safetensors=True).eval()


def random_images(count: int = 3, height: int = 40, width: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, height, width, generator=torch.Generator().manual_seed(seed))


def manual_image_embeddings(model: CLIPModel, images: torch.Tensor) -> torch.Tensor:
    pixels = torch.stack([clip_preprocess(image, 32, CLIP_MEAN, CLIP_STD) for image in images])
    with torch.no_grad():
        return F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)


# --- image forms --------------------------------------------------------------------------------


def test_image_forms_agree() -> None:
    batch = (random_images(2) * 255).round() / 255  # exactly representable in 8 bits
    pil_images = [
        Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()) for image in batch
    ]
    for form in (list(batch), pil_images):
        for expected, got in zip(batch, as_image_list(form), strict=True):
            torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        as_image_list(batch[0])
    with pytest.raises(TypeError, match="float tensors"):
        as_image_list([torch.zeros(3, 4, 4, dtype=torch.uint8)])


# --- JPEG ---------------------------------------------------------------------------------------


def test_jpeg_flat_image_compresses_better_than_noise() -> None:
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    batch = torch.cat([flat, noise])
    compressibility = REWARDS.get("jpeg_compressibility")()
    incompressibility = REWARDS.get("jpeg_incompressibility")(quality=80)

    scores = compressibility(batch)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    assert scores[0] > scores[1]
    assert incompressibility(batch)[0] < incompressibility(batch)[1]
    torch.testing.assert_close(compressibility(batch), scores)  # deterministic
    assert (scores < 0).all()
    with pytest.raises(ValueError, match="quality"):
        REWARDS.get("jpeg_compressibility")(quality=0)


# --- CLIP ---------------------------------------------------------------------------------------


def test_clip_preprocess_matches_clip_image_processor() -> None:
    """The torch recipe agrees with transformers' own (PIL) CLIP processor up to resampling noise."""
    ramp = torch.linspace(0, 1, 48)
    smooth = torch.stack(
        [ramp[None, :].expand(40, 48), ramp[:40, None].expand(40, 48), torch.full((40, 48), 0.3)]
    )
    pil_image = Image.fromarray((smooth * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    expected = processor(images=[pil_image], return_tensors="pt")["pixel_values"][0]

    got = clip_preprocess(as_image_list([pil_image])[0], 32, CLIP_MEAN, CLIP_STD)
    assert got.shape == expected.shape == (3, 32, 32)
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)


def test_clip_score_matches_a_manual_computation(clip_dir: Path, clip_model: CLIPModel) -> None:
    images = random_images()
    reward = REWARDS.get("clip_score")(model_path=str(clip_dir), device="cpu")

    scores = reward(images, prompts=PROMPTS, answers=["ignored"] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert scores.abs().max() <= 1
    torch.testing.assert_close(reward(list(images), prompts=PROMPTS), scores)

    tokenizer = CLIPTokenizer.from_pretrained(clip_dir)
    tokens = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        text = F.normalize(clip_model.get_text_features(**tokens).pooler_output, dim=-1)
    expected = (manual_image_embeddings(clip_model, images) * text).sum(-1)
    torch.testing.assert_close(scores, expected)

    scaled = REWARDS.get("clip_score")(model_path=str(clip_dir), scale=100.0, device="cpu")
    torch.testing.assert_close(scaled(images, prompts=PROMPTS), 100 * scores)
    pick = REWARDS.get("pickscore")(model_path=str(clip_dir), device="cpu")
    torch.testing.assert_close(pick(images, prompts=PROMPTS), clip_model.logit_scale.exp() * scores)


def test_clip_score_needs_one_prompt_per_image_and_truncates_long_ones(clip_dir: Path) -> None:
    reward = REWARDS.get("clip_score")(model_path=str(clip_dir), device="cpu")
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(random_images(2))
    with pytest.raises(ValueError, match="1 prompts for 2 images"):
        reward(random_images(2), prompts=["a cat"])
    assert reward(random_images(1), prompts=[" ".join(["cat"] * 40)]).shape == (1,)


# --- aesthetic ----------------------------------------------------------------------------------


def test_aesthetic_is_the_head_on_the_normalised_embedding(
    clip_dir: Path, clip_model: CLIPModel, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    head = AestheticHead(input_dim=16, hidden_dims=[8], activation="relu").eval()
    head_path = tmp_path / "head.safetensors"
    head.save(head_path)
    assert json.loads((tmp_path / "head.json").read_text())["hidden_dims"] == [8]

    images = random_images()
    reward = REWARDS.get("aesthetic")(model_path=str(clip_dir), head_path=str(head_path), device="cpu")
    scores = reward(images)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    with torch.no_grad():
        expected = head(manual_image_embeddings(clip_model, images))
    torch.testing.assert_close(scores, expected)


def test_aesthetic_head_errors(clip_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="aesthetic_head.safetensors"):
        REWARDS.get("aesthetic")(model_path=str(clip_dir), device="cpu")
    AestheticHead(input_dim=7).save(tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match="7-dim"):
        REWARDS.get("aesthetic")(model_path=str(clip_dir), head_path=str(tmp_path / "wrong.safetensors"))


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_missing_model_dir_names_the_path(name: str, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model.*save_pretrained"):
        REWARDS.get(name)(model_path=str(missing))
    with pytest.raises(FileNotFoundError, match="openai/clip-vit-base-patch32"):
        REWARDS.get(name)(model_path="openai/clip-vit-base-patch32")


# --- reward server ------------------------------------------------------------------------------

Responder = Callable[[int, dict], tuple[int, object]]


class FakeRewardServer(LocalServer):
    """A local reward server whose answer to the n-th request (from 0) is `respond(n, payload)`."""

    def __init__(self, respond: Responder) -> None:
        super().__init__()
        self.payloads: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.payloads.append(payload)
                status, answer = respond(len(server.payloads) - 1, payload)
                if status == 0:  # hang until the test ends
                    server.stopping.wait(10)
                    return
                body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                if status in (301, 302, 307):
                    self.send_header("Location", "http://example.com/steal")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler), "/reward")


@pytest.fixture
def serve() -> Iterator[Callable[[Responder], FakeRewardServer]]:
    servers: list[FakeRewardServer] = []

    def start(respond: Responder) -> FakeRewardServer:
        servers.append(FakeRewardServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def decoded_sizes(payload: dict) -> list[tuple[int, int]]:
    return [Image.open(io.BytesIO(base64.b64decode(image))).size for image in payload["images"]]


def test_http_reward_round_trip(serve: Callable[[Responder], FakeRewardServer]) -> None:
    def respond(_: int, payload: dict) -> tuple[int, object]:
        return 200, {
            "rewards": [
                width + len(prompt)
                for (width, _), prompt in zip(decoded_sizes(payload), payload["prompts"], strict=True)
            ]
        }

    server = serve(respond)
    reward = REWARDS.get("http_reward")(url=server.url, backoff=0.01)
    images = [torch.rand(3, 20, 30), torch.rand(3, 10, 12)]
    scores = reward(
        images, prompts=["a cat", "a red dog"], metadata=[{"step": 1}, {"step": 2}], answers=[1, 2]
    )

    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([30.0 + 5, 12.0 + 9]))
    payload = server.payloads[0]
    assert payload["prompts"] == ["a cat", "a red dog"]
    assert decoded_sizes(payload) == [(30, 20), (12, 10)]
    assert payload["metadata"] == [{"step": 1}, {"step": 2}]
    assert set(payload) == {"prompts", "images", "metadata"}

    reward(random_images(2))
    assert server.payloads[1]["prompts"] == ["", ""] and "metadata" not in server.payloads[1]


def test_http_reward_retries_server_errors(serve: Callable[[Responder], FakeRewardServer]) -> None:
    server = serve(lambda n, _: (500, {"error": "busy"}) if n < 2 else (200, {"rewards": [0.5]}))
    reward = REWARDS.get("http_reward")(url=server.url, retries=3, backoff=0.01)
    torch.testing.assert_close(reward(random_images(1)), torch.tensor([0.5]))
    assert len(server.payloads) == 3


def test_http_reward_gives_up_after_retries(serve: Callable[[Responder], FakeRewardServer]) -> None:
    server = serve(lambda n, _: (500, {"error": "down"}))
    reward = REWARDS.get("http_reward")(url=server.url, retries=3, backoff=0.01)
    with pytest.raises(RewardServerError, match=f"{server.url}.*3 times.*500"):
        reward(random_images(1))
    assert len(server.payloads) == 3


def test_http_reward_times_out(serve: Callable[[Responder], FakeRewardServer]) -> None:
    server = serve(lambda n, _: (0, None))
    reward = REWARDS.get("http_reward")(url=server.url, timeout=0.2, retries=2, backoff=0.01)
    with pytest.raises(RewardServerError, match=f"{server.url}.*2 times.*timed out"):
        reward(random_images(1))


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ({"rewards": [1.0]}, "1 rewards for 2 images"),
        ({"rewards": [1.0, "high"]}, "non-numeric"),
        (b'{"rewards": [1.0, NaN]}', "non-finite"),
        ({"rewards": [1.0, True]}, "non-numeric"),
        ({"scores": [1.0, 2.0]}, "without a 'rewards' list"),
        (b"<html>oops</html>", "invalid JSON"),
    ],
)
def test_http_reward_rejects_bad_answers(
    serve: Callable[[Responder], FakeRewardServer], answer: object, problem: str
) -> None:
    server = serve(lambda n, _: (200, answer))
    reward = REWARDS.get("http_reward")(url=server.url, backoff=0.01)
    with pytest.raises(RewardServerError, match=problem):
        reward(random_images(2))
    assert len(server.payloads) == 1  # a malformed answer is not retried


@pytest.mark.parametrize(("status", "problem"), [(400, "HTTP 400"), (302, "redirects are not followed")])
def test_http_reward_does_not_retry_client_errors_or_follow_redirects(
    serve: Callable[[Responder], FakeRewardServer], status: int, problem: str
) -> None:
    server = serve(lambda n, _: (status, {"error": "no"}))
    reward = REWARDS.get("http_reward")(url=server.url, backoff=0.01)
    with pytest.raises(RewardServerError, match=problem):
        reward(random_images(1))
    assert len(server.payloads) == 1


def test_http_reward_checks_its_options() -> None:
    assert urllib.parse.urlsplit(DEFAULT_REWARD_SERVER_URL).hostname == "127.0.0.1"
    assert callable(REWARDS.get("http_reward")())  # building contacts no server
    for bad_url in ("file:///etc/passwd", "localhost:8000", "ftp://127.0.0.1/x"):
        with pytest.raises(ValueError, match="http"):
            REWARDS.get("http_reward")(url=bad_url)
    with pytest.raises(ValueError, match="retries"):
        REWARDS.get("http_reward")(retries=0)
