"""A tiny replica of LeRobot's SmolVLA for a sim task (`mmrl replica smolvla`), in the LeRobot
environment of docs/robot.md (LeRobot policies): the `vla/smolvla_habc` recipe runs on it on a CPU
by the same code path as on `lerobot/smolvla_base` fine-tuned for the task.

SmolVLA is SmolVLM2's first layers with an action expert beside them, trained by flow matching. The
replica keeps LeRobotPolicy's SmolVLA class and its own config defaults, except the sizes: a SmolVLM
backbone built here from a scaled-down config (a llama text model, a SigLIP vision tower, a
word-level tokenizer holding SmolVLM's special tokens and the sim's instruction words, its image
processor), written next to the policy and named by `vlm_model_name`, so that nothing is downloaded;
frames at the task's render size instead of 512 px; shorter action chunks and fewer flow steps. The
policy is saved with its pre/post-processors, whose statistics are standard (mean 0, std 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmrl.config import ConfigError
from mmrl.registry import REPLICAS
from vla_rl.lerobot_policy import import_lerobot

IMAGE_SIZE = 32  # the envs render at the policy's camera size


def tiny_smolvlm(directory: str | Path, words: list[str], image_size: int = IMAGE_SIZE) -> Path:
    """A tiny SmolVLM backbone as SmolVLA loads it by `vlm_model_name`: config, a word-level tokenizer
    with SmolVLM's special tokens and `words`, image and video processors (no weights: SmolVLA builds
    them from the config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    directory = Path(directory)
    special = ["<pad>", "<unk>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]
    special.append("<global-img>")
    vocab = {token: i for i, token in enumerate(special + sorted(set(words) - set(special)))}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        additional_special_tokens=special[2:],
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )
    text = {"model_type": "llama", "vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": image_size, "patch_size": 8}
    SmolVLMConfig(
        text_config=text, vision_config=vision, scale_factor=2, image_token_id=vocab["<image>"]
    ).save_pretrained(directory)
    images = SmolVLMImageProcessor(
        do_resize=False, do_image_splitting=False, size={"longest_edge": image_size}
    )
    SmolVLMProcessor(
        image_processor=images, tokenizer=tokenizer, video_processor=SmolVLMVideoProcessor(), image_seq_len=4
    ).save_pretrained(directory)
    return directory


@REPLICAS.register("smolvla")
def smolvla(
    directory: str | Path, seed: int = 0, full: bool = False, weights: bool | None = None, device: str = "cpu"
) -> Path:
    """LeRobot's SmolVLA (`lerobot/smolvla_base`) for PickPlace: camera frames, proprioception and the
    5 action entries of the sim, with its VLM backbone in `directory`/vlm. Tiny only: the full-size
    model is smolvla_base itself, whose VLM config comes from the hub."""
    if full:
        raise ConfigError(
            "mmrl replica smolvla: full=true: there is no full-size replica, as SmolVLA's VLM (SmolVLM2) "
            "config comes from the hub; fine-tune lerobot/smolvla_base itself for the real model"
        )
    if weights is False:
        raise ConfigError("mmrl replica smolvla: weights=false: the replica is small and always has them")
    try:
        lerobot = import_lerobot()
    except ImportError as err:
        raise ConfigError(f"mmrl replica smolvla needs LeRobot: {err}") from None
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    from sim.env import PROPRIO
    from vla_rl.policy import task_vocabulary

    directory = Path(directory)
    proprio, actions = sum(size for _, size in PROPRIO), 5
    config = SmolVLAConfig(
        input_features={
            "observation.image": PolicyFeature(FeatureType.VISUAL, (3, IMAGE_SIZE, IMAGE_SIZE)),
            "observation.state": PolicyFeature(FeatureType.STATE, (proprio,)),
        },
        output_features={"action": PolicyFeature(FeatureType.ACTION, (actions,))},
        device=device,
        push_to_hub=False,
        vlm_model_name=str(tiny_smolvlm(directory / "vlm", task_vocabulary())),
        load_vlm_weights=False,
        chunk_size=8,
        n_action_steps=4,
        num_steps=2,
        resize_imgs_with_padding=(IMAGE_SIZE, IMAGE_SIZE),
        tokenizer_max_length=16,
        max_state_dim=16,
        max_action_dim=8,
    )
    stats = {
        key: {"mean": torch.zeros(shape), "std": torch.ones(shape)}
        for key, shape in (("observation.state", proprio), ("action", actions))
    }
    torch.manual_seed(seed)
    policy = lerobot["get_policy_class"]("smolvla")(config)
    preprocessor, postprocessor = lerobot["make_pre_post_processors"](config, dataset_stats=stats)
    for part in (policy, preprocessor, postprocessor):
        part.save_pretrained(directory)
    return directory
