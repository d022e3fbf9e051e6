"""
timm, diffusers and torchvision for the sweep. A library that cannot be imported gives one NOT-BUILDABLE case
with the reason.

- diffusers: every ModelMixin class the package exports, built from its constructor's defaults shrunk (tiny.py's
  rules: widths, depths, heads, sample sizes), run on latents (images, video or sequences: the first layout its
  forward takes) with a timestep, text states and pooled projections where it takes them; each example's loss a
  fixed random projection of its output sample.
- timm: one model per family of timm.list_models() (the family: the name up to its first '_' or digit), the
  family's smallest by parameter count (counted on the meta device), random weights, 3 classes, a 32x32 input
  where the model takes it (else its default input size).
- torchvision: every classification model of torchvision.models.list_models(module=torchvision.models), random
  weights, 3 classes, 32x32 inputs where the model takes them (else 64, then its default).
"""

import importlib
import inspect
import re

import torch

from sweep.check import NotBuildable, Prepared, checked_losses, one_line
from sweep.tiny import ATTEMPTS, tiny_arguments

B = 3
MAX_PARAMETERS = 5_000_000


# why a library may be absent where this sweep runs (the lead's machine: torch 2.13.0+cpu, no network but PyPI's
# mirror): the only torchvision wheel there is PyPI's CUDA build, whose C++ ops cannot load against a CPU torch
# (its import fails registering torchvision::nms), and timm imports torchvision (timm.layers: FrozenBatchNorm2d)
WHY_ABSENT = {
    "torchvision": "a torchvision build matching torch 2.13.0+cpu is needed (PyPI's 0.28.0 wheel is the CUDA build, "
    "whose ops do not load against a CPU torch; the CPU index has it)",
    "timm": "timm needs torchvision (timm.layers imports its FrozenBatchNorm2d)",
}


def _missing(Case, library, error):
    def prepare():
        why = f"; {WHY_ABSENT[library]}" if library in WHY_ABSENT else ""
        raise NotBuildable(f"{library} cannot be imported here ({error}){why}")

    return [Case(library, "all", "-", library, prepare)]


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # an absent package, or a build that cannot load against this torch
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _projection_loss(forward, examples, pick):
    """loss_of(part): each example's fixed random projection of pick(forward(**its part))."""
    weights = {}

    def loss_of(part):
        out = pick(forward(**{k: v[part] if _per_example(v) else v for k, v in examples.items()}))
        n = part.stop - part.start
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != n:
            raise NotBuildable(f"its output {type(out).__name__} has no per-example dim 0")
        shape = (B, *out.shape[1:])
        if shape not in weights:
            weights[shape] = torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        return (out.double() * weights[shape][part]).flatten(1).sum(1) / out[0].numel()

    return loss_of


def _per_example(value):
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B


# -----------------------------------------------------------------------------
# diffusers


def diffusers_cases(Case):
    diffusers, error = _import("diffusers")
    if diffusers is None:
        return _missing(Case, "diffusers", error)
    found = []
    for name in sorted(dir(diffusers)):
        try:
            cls = getattr(diffusers, name)
        except Exception:  # an export whose optional dependency is missing
            continue
        if inspect.isclass(cls) and issubclass(cls, diffusers.ModelMixin) and cls is not diffusers.ModelMixin:
            task = _diffusers_task(name)
            found.append(Case("diffusers", task, name, name, lambda name=name: _diffusers_prepare(name)))
    return found


def _diffusers_task(name):
    if "ControlNet" in name or "Adapter" in name:
        return "control"
    if name.startswith(("Autoencoder", "VQ", "ConsistencyDecoder")) or "VAE" in name or "Vae" in name:
        return "autoencoder"
    if "UNet" in name or "Unet" in name:
        return "unet"
    if "Transformer" in name or "DiT" in name or "Dit" in name:
        return "transformer"
    return "other"


_TEXT_WIDTHS = (
    "cross_attention_dim",
    "joint_attention_dim",
    "caption_channels",
    "text_embed_dim",
    "encoder_hid_dim",
    "text_dim",
    "caption_projection_dim",
    "context_dim",
)


def _diffusers_prepare(name):
    import diffusers

    cls = getattr(diffusers, name)
    first = None
    for attempt in range(len(ATTEMPTS)):
        try:
            defaults = {
                k: p.default
                for k, p in inspect.signature(cls.__init__).parameters.items()
                if k != "self" and p.default is not inspect.Parameter.empty
            }
            kwargs = tiny_arguments(defaults, attempt)
            with torch.device("meta"):
                count = sum(p.numel() for p in cls(**kwargs).parameters())
            if count > MAX_PARAMETERS:
                raise NotBuildable(f"its tiny config still has {count / 1e6:.1f}M parameters (a size no rule shrinks)")
            torch.manual_seed(0)
            model = cls(**kwargs).double().train()
            loss_of, described = _diffusers_examples(model)
            return Prepared(model, loss_of, B, described + (f" (sizes of attempt {attempt})" if attempt else ""))
        except NotBuildable as e:
            first = first or str(e)
        except Exception as e:
            first = first or f"its tiny model or inputs could not be made ({one_line(e)})"
    raise NotBuildable(first)


def _diffusers_examples(model):
    """(loss_of, what the examples are) for the first latent layout the model's forward runs on."""
    config = dict(model.config)
    params = inspect.signature(model.forward).parameters
    names = [k for k in params if k != "self"]
    main = names[0]
    gen = torch.Generator().manual_seed(12)
    channels = config.get("in_channels") or config.get("latent_channels") or 4
    size = config.get("sample_size") or 16
    size = size[0] if isinstance(size, (list, tuple)) else size
    extra = {}
    if "timestep" in params:
        extra["timestep"] = torch.tensor([10, 500, 990])
    width = next((config[k] for k in _TEXT_WIDTHS if isinstance(config.get(k), int)), None)
    if "encoder_hidden_states" in params and width:
        extra["encoder_hidden_states"] = torch.randn(B, 4, width, generator=gen, dtype=torch.float64)
    if "pooled_projections" in params and isinstance(config.get("pooled_projection_dim"), int):
        extra["pooled_projections"] = torch.randn(
            B, config["pooled_projection_dim"], generator=gen, dtype=torch.float64
        )
    if "class_labels" in params and (config.get("num_embeds_ada_norm") or config.get("num_class_embeds")):
        extra["class_labels"] = torch.tensor([1, 2, 0])
    layouts = [
        ("images", (B, channels, size, size)),
        ("video", (B, channels, 2, size, size)),
        ("sequences", (B, size, channels)),
        ("signals", (B, channels, 4 * size)),
    ]
    errors = []
    for what, shape in layouts:
        examples = {main: torch.randn(*shape, generator=gen, dtype=torch.float64), **extra}
        loss_of = _projection_loss(model, examples, _sample_of)
        try:
            return checked_losses(loss_of, B), f"{what} {'x'.join(map(str, shape[1:]))}" + (
                f" with {', '.join(extra)}" if extra else ""
            )
        except NotBuildable as e:
            errors.append(str(e))
        except Exception as e:
            errors.append(one_line(e, 160))
    raise NotBuildable("its examples could not be made: " + " | ".join(dict.fromkeys(errors)))


def _sample_of(out):
    for key in ("sample", "x", "latent_dist"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
        if key == "latent_dist" and value is not None:
            return value.mean
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


# -----------------------------------------------------------------------------
# timm and torchvision (classification: a 3-class head on random weights)


def timm_cases(Case):
    timm, error = _import("timm")
    if timm is None:
        return _missing(Case, "timm", error)
    families = {}
    for name in timm.list_models():
        families.setdefault(re.split(r"[_\d]", name, maxsplit=1)[0], []).append(name)
    return [
        Case("timm", "image-classification", family, family, lambda names=names: _timm_prepare(names))
        for family, names in sorted(families.items())
    ]


def _timm_prepare(names):
    import timm

    sizes = {}
    for name in names:
        try:
            with torch.device("meta"):
                sizes[name] = sum(
                    p.numel() for p in timm.create_model(name, pretrained=False, num_classes=3).parameters()
                )
        except Exception:
            continue
    if not sizes:
        raise NotBuildable(f"none of its {len(names)} models could be made on the meta device")
    name = min(sizes, key=lambda n: (sizes[n], n))
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=3).double().train()
    default = getattr(model, "default_cfg", {}).get("input_size", (3, 224, 224))
    return _classifier(model, name, [(default[0], 32, 32), tuple(default)])


def torchvision_cases(Case):
    torchvision, error = _import("torchvision")
    if torchvision is None:
        return _missing(Case, "torchvision", error)
    names = torchvision.models.list_models(module=torchvision.models)
    return [
        Case("torchvision", "image-classification", name, name, lambda name=name: _torchvision_prepare(name))
        for name in sorted(names)
    ]


def _torchvision_prepare(name):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=3).double().train()
    return _classifier(model, name, [(3, 32, 32), (3, 64, 64), (3, 224, 224)])


def _classifier(model, name, sizes):
    errors = []
    for size in sizes:
        pixels = torch.randn(B, *size, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
        loss_of = _projection_loss(
            lambda x: model(x), {"x": pixels}, lambda out: out[0] if isinstance(out, tuple) else out
        )
        try:
            return Prepared(model, checked_losses(loss_of, B), B, f"{name}, images {'x'.join(map(str, size))}")
        except NotBuildable as e:
            errors.append(str(e))
        except Exception as e:
            errors.append(one_line(e, 160))
    raise NotBuildable("its examples could not be made: " + " | ".join(dict.fromkeys(errors)))
