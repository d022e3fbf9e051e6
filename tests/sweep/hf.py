"""
transformers' architectures for the sweep: every model class of the auto mappings of the heads people train, each
built from a tiny config of its config class (tiny.py) and run on examples made for its task.

    cases()                       [(task, model_type, class name)], enumerated from the auto mappings
    prepare(task, model_type, class_name)    -> check.Prepared (raises check.NotBuildable with the reason)

Examples: B = 3 of them, split into micro-batches of 1 and 2; text of T = 7 tokens, example 1 padded on its last
2 (attention mask 0, pad ids); images, audio and series sized from the config. Each example's loss is a fixed random
projection of the model's own per-example outputs (logits, start and end logits, predictions), so any head is a
loss and the losses are the examples' own.

Vision-language and audio-language models get their images (or audio) where their forward wants them: example 0
one image, example 1 none, example 2 two (so a micro-batch holds an example with several images and one with none),
as many image tokens per image in input_ids as the model's features have (read from the model's own count check:
"Image features and image tokens do not match, tokens: X, features: Y"), between the config's start and end
tokens where it has them; pixel layouts by what the forward takes (a grid of patches with image_grid_thw, tiles
with pixel_attention_mask, else images). A model whose images cannot be made so runs on its text alone, and says so.
"""

import inspect
import re
import sys

import torch
import transformers
from transformers.models.auto import modeling_auto

from sweep.check import NotBuildable, Prepared, checked_losses, one_line
from sweep.tiny import ATTEMPTS, VOCAB, sections, tiny_config

TASKS = {  # the sweep's task name: transformers' auto mapping of that head
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "multiple-choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "time-series-prediction": "MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES",
    "time-series-classification": "MODEL_FOR_TIME_SERIES_CLASSIFICATION_MAPPING_NAMES",
    "time-series-regression": "MODEL_FOR_TIME_SERIES_REGRESSION_MAPPING_NAMES",
}
B, T, CHOICES, DECODER_T = 3, 7, 2, 5
IMAGES = (1, 0, 2)  # images (or audio clips) of each example
MAX_PARAMETERS = 5_000_000  # a tiny config still larger than this is not tiny (its sizes were not all shrunk)
OUTPUTS = ("logits", "start_logits", "end_logits", "prediction_outputs", "regression_outputs", "mean_predictions")


def cases():
    """[(task, model_type, class name)] of every model class in the auto mappings of TASKS, in order."""
    found = []
    for task, mapping in TASKS.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in (names,) if isinstance(names, str) else names:
                found.append((task, model_type, name))
    return found


# -----------------------------------------------------------------------------
# building


def _config_class(model_type, model_cls):
    config_cls = transformers.CONFIG_MAPPING[model_type]
    own = getattr(model_cls, "config_class", None)
    if own is not None and not issubclass(config_cls, own):  # a text-only head of a composite model type
        return own
    return config_cls


def _text_config(config):
    try:
        return config.get_text_config()
    except Exception:
        return config


def _settle(config):
    """Settings every tiny model gets: a pad id (sequence classification finds each example's last token by it)."""
    for c in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        if getattr(c, "pad_token_id", 0) is None and hasattr(c, "vocab_size"):
            c.pad_token_id = 0
    return config


def _fit_default_rotary_sections(config, model_cls):
    """A model whose code defaults mrope_section (Qwen2-VL's [16, 24, 24], for a 128-wide head) when its config
    names none gets sections that fit the tiny head."""
    source = inspect.getsource(sys.modules[model_cls.__module__])
    if "mrope_section" not in source:
        return
    for c in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        rope = getattr(c, "rope_parameters", None)
        head = getattr(c, "head_dim", None) or (
            c.hidden_size // c.num_attention_heads
            if hasattr(c, "hidden_size") and hasattr(c, "num_attention_heads")
            else None
        )
        if isinstance(rope, dict) and "mrope_section" not in rope and isinstance(head, int):
            c.rope_parameters = {**rope, "mrope_section": sections([1, 1, 1], head // 2)}


def build(model_type, class_name, attempt):
    """The tiny model of one attempt (float64, eager attention, training mode); raises what building raises."""
    model_cls = getattr(transformers, class_name, None)
    if model_cls is None:
        raise NotBuildable(f"transformers {transformers.__version__} has no class {class_name}")
    config = _settle(tiny_config(_config_class(model_type, model_cls), attempt))
    _fit_default_rotary_sections(config, model_cls)
    with torch.device("meta"):
        count = sum(p.numel() for p in model_cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise NotBuildable(f"its tiny config still has {count / 1e6:.1f}M parameters (a size no rule shrinks)")
    torch.manual_seed(0)
    model = model_cls(config)
    for setter, value in (("set_attn_implementation", "eager"), ("set_experts_implementation", "eager")):
        try:
            getattr(model, setter)(value)
        except Exception:
            pass  # a model with one implementation
    return model.double().train()


# -----------------------------------------------------------------------------
# examples


def _forward_params(model):
    return inspect.signature(model.forward).parameters


def _pad_id(config):
    pad = getattr(_text_config(config), "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0


def _text(config, n=B, length=T, seed=1):
    """(ids (n, length), mask (n, length)): random ids below the renumbered special tokens; example 1 padded."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min(getattr(_text_config(config), "vocab_size", VOCAB) or VOCAB, VOCAB)
    ids = torch.randint(3, max(4, vocab - 24), (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    if n > 1:
        mask[1, -2:] = 0
        ids[1, -2:] = _pad_id(config)
    return ids, mask


class Examples:
    """The step's examples as one batch of tensors, each input's example dim saying how a micro-batch is cut:
    `per_example` inputs have the examples on dim 0 (sliced), `owned` inputs have rows owned by examples (their
    images, patches or grids: cut by `owner`, left out when the micro-batch owns none)."""

    def __init__(self, per_example, owned=None, owner=None, described=""):
        self.per_example, self.owned, self.owner, self.described = per_example, owned or {}, owner, described

    def part(self, part):
        kwargs = {k: v[part] for k, v in self.per_example.items()}
        for key, (value, owner) in self.owned.items():
            mine = (owner >= part.start) & (owner < part.stop)
            if mine.any():
                kwargs[key] = value[mine]
        return kwargs


def _outputs(out, n):
    """The model's per-example outputs (OUTPUTS present, as tensors with the examples on dim 0)."""
    found = []
    for key in OUTPUTS:
        value = out.get(key) if hasattr(out, "get") else None
        for t in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 and t.shape[0] == n:
                found.append((key, t))
    return found


def _loss_of(model, examples, extra=None):
    """loss_of(part): each example's fixed random projection of its outputs (the same weights whatever the part)."""
    weights = {}

    def weight(key, t):
        shape = (B, *t.shape[1:])
        if (key, shape) not in weights:
            gen = torch.Generator().manual_seed(len(weights) + 7)
            weights[key, shape] = torch.randn(shape, generator=gen, dtype=torch.float64)
        return weights[key, shape]

    def loss_of(part):
        n = part.stop - part.start
        out = model(**examples.part(part), **(extra or {}))
        found = _outputs(out, n)
        if not found:
            keys = list(out.keys()) if hasattr(out, "keys") else type(out).__name__
            raise NotBuildable(f"no per-example output among {keys}")
        total = 0
        for key, t in found:
            w = weight(key, t)[part]
            total = total + (t.double() * w).flatten(1).sum(1) / t[0].numel()
        return total

    return loss_of


def _runs(model, examples):
    """loss_of if the plain model runs on the whole batch and on the micro-batches, with per-example losses."""
    return checked_losses(_loss_of(model, examples), B)


def _text_examples(model, config, task):
    ids, mask = _text(config)
    params = _forward_params(model)
    per_example = {"input_ids": ids}
    if "attention_mask" in params:
        per_example["attention_mask"] = mask
    if task == "multiple-choice":
        choices, choice_mask = _text(config, B * CHOICES, seed=2)
        choice_mask[:] = 1
        choice_mask[CHOICES : 2 * CHOICES, -2:] = 0  # example 1's choices padded
        per_example = {"input_ids": choices.view(B, CHOICES, T)}
        if "attention_mask" in params:
            per_example["attention_mask"] = choice_mask.view(B, CHOICES, T)
    if "decoder_input_ids" in params and task in ("seq2seq-lm", "image-text-to-text", "speech-seq2seq"):
        per_example["decoder_input_ids"], _ = _text(config, length=DECODER_T, seed=3)
        per_example["decoder_input_ids"][:, 0] = _start_token(config)
    if "bbox" in params and task not in ("image-text-to-text",):  # layout models: each token's box
        per_example["bbox"] = torch.tensor([1, 2, 3, 4]).expand(B, ids.shape[-1], 4).clone()
    return per_example


def _start_token(config):
    found = getattr(config, "decoder_start_token_id", None) or getattr(_text_config(config), "bos_token_id", None)
    return found if isinstance(found, int) and 0 <= found < VOCAB else 0


def _image_size(config):
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None) or getattr(config, "image_size", None) or 32
    if isinstance(size, dict):
        size = size.get("height", 32)
    return (size[0], size[1]) if isinstance(size, (list, tuple)) else (size, size)


def _channels(config):
    vision = getattr(config, "vision_config", None) or config
    return getattr(vision, "num_channels", None) or getattr(config, "num_channels", None) or 3


def _image_examples(model, config):
    gen = torch.Generator().manual_seed(4)
    height, width = _image_size(config)
    pixels = torch.randn(B, _channels(config), height, width, generator=gen, dtype=torch.float64)
    return Examples({"pixel_values": pixels}, described=f"images {_channels(config)}x{height}x{width}")


def _audio_lengths(config):
    positions = getattr(config, "max_source_positions", None)
    return ([2 * positions] if positions else []) + [64, 32, 128, 16]


def _audio_candidates(model, config):
    """Examples of audio in the layouts a model may take, the most common first."""
    gen = torch.Generator().manual_seed(5)
    name = getattr(model, "main_input_name", "input_values")
    if name == "input_values" or "input_values" in _forward_params(model):
        for samples in (1600, 4000, 400):
            audio = torch.randn(B, samples, generator=gen, dtype=torch.float64)
            yield Examples({"input_values": audio}, described=f"waveforms of {samples} samples")
    bins = next(
        (
            getattr(config, k)
            for k in ("num_mel_bins", "feature_size", "input_feat_size", "n_mel_bins")
            if isinstance(getattr(config, k, None), int)
        ),
        16,
    )
    for frames in _audio_lengths(config):
        features = torch.randn(B, bins, frames, generator=gen, dtype=torch.float64)
        yield Examples({"input_features": features}, described=f"features {bins}x{frames}")
        yield Examples({"input_features": features.transpose(1, 2).contiguous()}, described=f"features {frames}x{bins}")


def _series_candidates(model, config):
    gen = torch.Generator().manual_seed(6)
    length = getattr(config, "context_length", None) or 32
    channels = getattr(config, "num_input_channels", None) or 1
    values = torch.randn(B, length, channels, generator=gen, dtype=torch.float64)
    yield Examples({"past_values": values}, described=f"series {length}x{channels}")
    flat = torch.randn(B, length, generator=gen, dtype=torch.float64)
    yield Examples({"past_values": flat}, described=f"series of {length}")


def _with_decoder(model, config, examples):
    if "decoder_input_ids" in _forward_params(model) and "decoder_input_ids" not in examples.per_example:
        ids, _ = _text(config, length=DECODER_T, seed=3)
        ids[:, 0] = _start_token(config)
        examples.per_example["decoder_input_ids"] = ids
    return examples


# -----------------------------------------------------------------------------
# images (or audio) in a language model's input_ids

_COUNT = re.compile(
    r"(?:features|tokens) and (?:\w+ )?(?:placeholder )?tokens do not match, tokens: (\d+), features: (\d+)"
)


def _token_id(config, *names):
    for c in (config, _text_config(config)):
        for name in names:
            value = getattr(c, name, None)
            if isinstance(value, int) and 0 <= value < VOCAB:
                return value
    return None


class _Multimodal:
    """A vision- or audio-language model's examples: each example's items (images or clips) as `k` placeholder
    tokens each in its input_ids, and the items' pixels (or features) in the layout its forward takes."""

    def __init__(self, model, config, modality):
        self.model, self.config, self.modality = model, config, modality
        self.params = _forward_params(model)
        if modality == "image":
            self.token = _token_id(config, "image_token_id", "image_token_index", "image_token")
            self.start = _token_id(
                config, "vision_start_token_id", "boi_token_id", "image_start_token_id", "boi_token_index"
            )
            self.end = _token_id(config, "vision_end_token_id", "eoi_token_id", "image_end_token_id", "eoi_token_index")
        else:
            self.token = _token_id(config, "audio_token_id", "audio_token_index", "audio_token")
            self.start = _token_id(config, "audio_start_token_id", "boa_token_id", "audio_bos_token_id")
            self.end = _token_id(config, "audio_end_token_id", "eoa_token_id", "audio_eos_token_id")
        if self.token is None:
            raise NotBuildable(f"its config names no {modality} token")

    def layout(self):
        if self.modality == "audio":
            return "features"
        if "image_grid_thw" in self.params:
            return "grid"
        if "pixel_attention_mask" in self.params:
            return "tiles"
        return "images"

    def items(self, gen):
        """(the items' inputs {name: (value, owner)} and the per-example inputs they add)."""
        counts = torch.tensor(IMAGES)
        owner = torch.repeat_interleave(torch.arange(B), counts)
        total = int(counts.sum())
        layout = self.layout()
        if layout == "features":
            audio = getattr(self.config, "audio_config", None) or self.config
            bins = next(
                (
                    getattr(audio, k)
                    for k in ("num_mel_bins", "feature_size", "input_feat_size")
                    if isinstance(getattr(audio, k, None), int)
                ),
                16,
            )
            frames = 2 * getattr(audio, "max_source_positions", 16)
            features = torch.randn(total, bins, frames, generator=gen, dtype=torch.float64)
            owned = {"input_features": (features, owner)}
            if "feature_attention_mask" in self.params:
                owned["feature_attention_mask"] = (torch.ones(total, frames, dtype=torch.long), owner)
            elif "input_features_mask" in self.params:
                owned["input_features_mask"] = (torch.ones(total, frames, dtype=torch.bool), owner)
            return owned, {}, f"audio features {bins}x{frames} per clip"
        vision = getattr(self.config, "vision_config", None) or self.config
        height, width = _image_size(self.config)
        channels = _channels(self.config)
        if layout == "grid":
            patch = getattr(vision, "patch_size", 4)
            temporal = getattr(vision, "temporal_patch_size", 1) or 1
            merge = getattr(vision, "spatial_merge_size", 2) or 2
            side = 2 * merge
            rows = torch.randn(
                total * side * side, channels * temporal * patch * patch, generator=gen, dtype=torch.float64
            )
            patch_owner = torch.repeat_interleave(owner, side * side)
            grid = torch.tensor([[1, side, side]] * total)
            return (
                {"pixel_values": (rows, patch_owner), "image_grid_thw": (grid, owner)},
                {},
                f"patch grids 1x{side}x{side} per image",
            )
        pixels = torch.randn(total, channels, height, width, generator=gen, dtype=torch.float64)
        if layout == "tiles":  # (examples, tiles, C, H, W), zero tiles where an example has fewer
            tiles = torch.zeros(B, max(IMAGES), channels, height, width, dtype=torch.float64)
            mask = torch.zeros(B, max(IMAGES), height, width, dtype=torch.long)
            for i, count in enumerate(IMAGES):
                tiles[i, :count] = pixels[owner == i]
                mask[i, :count] = 1
            return {}, {"pixel_values": tiles, "pixel_attention_mask": mask}, f"tiles {height}x{width}"
        owned = {"pixel_values": (pixels, owner)}
        if "image_sizes" in self.params:
            owned["image_sizes"] = (torch.tensor([[height, width]] * total), owner)
        return owned, {}, f"images {channels}x{height}x{width}"

    def examples(self, per_item):
        """Examples with `per_item` placeholder tokens per item."""
        gen = torch.Generator().manual_seed(7)
        owned, per_example_items, described = self.items(gen)
        block = per_item + (self.start is not None) + (self.end is not None)
        length = 1 + max(IMAGES) * block + 4
        ids, mask = _text(self.config, length=length)
        for example, count in enumerate(IMAGES):
            at = 1
            for _ in range(count):
                if self.start is not None:
                    ids[example, at] = self.start
                    at += 1
                ids[example, at : at + per_item] = self.token
                at += per_item
                if self.end is not None:
                    ids[example, at] = self.end
                    at += 1
        per_example = {"input_ids": ids}
        if "attention_mask" in self.params:
            per_example["attention_mask"] = mask
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in self.params and self.modality == "image":
                per_example[name] = (ids == self.token).long()
        per_example.update(per_example_items)
        examples = Examples(
            per_example,
            owned,
            described=f"text of {length} tokens with {described}, "
            f"{per_item} tokens each, {'/'.join(map(str, IMAGES))} per example",
        )
        return _with_decoder(self.model, self.config, examples)

    def made(self):
        """Examples whose placeholder count the model accepts: found from its own count check."""
        per_item, seen = 1, set()
        while per_item not in seen:
            seen.add(per_item)
            examples = self.examples(per_item)
            try:
                return examples, _runs(self.model, examples)
            except NotBuildable:
                raise
            except Exception as e:
                match = _COUNT.search(str(e))
                if not match:
                    raise
                tokens, features = int(match.group(1)), int(match.group(2))
                items = tokens // per_item if per_item else 1
                if not items or features % items:
                    raise
                per_item = features // items
        raise NotBuildable(f"its {self.modality} token count could not be found")


# -----------------------------------------------------------------------------
# one case


def _examples_and_loss(model, config, task):
    """(Examples, loss_of) of the first layout the plain model runs on."""
    errors = []

    def attempt(examples):
        try:
            return examples, _runs(model, examples)
        except NotBuildable as e:
            errors.append(str(e))
        except Exception as e:
            errors.append(one_line(e, 200))
        return None

    main = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model)
    if task == "image-text-to-text" or (main == "input_ids" and task == "speech-seq2seq"):
        modality = "image" if task == "image-text-to-text" else "audio"
        try:
            return _Multimodal(model, config, modality).made()
        except Exception as e:
            errors.append(f"its {modality}s: {one_line(e, 200)}")
        text = Examples(_text_examples(model, config, task))
        found = attempt(text)
        if found:
            text.described = f"text only ({errors[0]})"
            return found
    elif main == "pixel_values" or task == "image-classification":
        found = attempt(_with_decoder(model, config, _image_examples(model, config)))
        if found:
            return found
    elif main in ("input_values", "input_features") or task in ("ctc", "audio-classification", "speech-seq2seq"):
        for examples in _audio_candidates(model, config):
            found = attempt(_with_decoder(model, config, examples))
            if found:
                return found
    elif main == "past_values" or task.startswith("time-series"):
        for examples in _series_candidates(model, config):
            found = attempt(examples)
            if found:
                return found
    else:
        examples = Examples(_text_examples(model, config, task), described=_text_description(task, params))
        found = attempt(examples)
        if found:
            return found
    raise NotBuildable("its examples could not be made: " + " | ".join(dict.fromkeys(errors)))


def _text_description(task, params):
    if task == "multiple-choice":
        return f"{CHOICES} choices of {T} tokens per example"
    what = f"text of {T} tokens"
    return what + (", a decoder's 5" if "decoder_input_ids" in params and task == "seq2seq-lm" else "")


def prepare(task, model_type, class_name):
    """check.Prepared for one (task, model type, class): the first attempt of tiny.ATTEMPTS whose model builds
    and runs on its examples; NotBuildable with the first attempt's reason when none does."""
    first = None
    for attempt in range(len(ATTEMPTS)):
        try:
            model = build(model_type, class_name, attempt)
            config = model.config
            examples, loss_of = _examples_and_loss(model, config, task)
        except NotBuildable as e:
            first = first or str(e)
            if str(e).startswith("transformers "):
                break
            continue
        except Exception as e:
            first = first or f"its tiny config or model could not be made ({one_line(e)})"
            continue
        inputs = examples.described or _text_description(task, _forward_params(model))
        if attempt:
            inputs += f" (sizes of attempt {attempt})"
        return Prepared(model, loss_of, B, inputs)
    raise NotBuildable(first)
