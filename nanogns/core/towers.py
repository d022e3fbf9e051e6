"""
Vision towers: which example each image, and each of its patches, belongs to.

A vision-language model runs its images through a tower (and a projector) whose rows are images or patches, not
the examples: SmolVLM splits each image into tiles and drops the padding ones, Qwen2-VL flattens every image's
patches into one (P, D) batch, a model may see several images per example or none. The rows are made from the
model's inputs this way: each image's features replace, in order, the image tokens of `input_ids` (the model
scatters them there), so the example of image j is the example holding its first image token. Its number of
tokens is the same for every image (the tokens of the batch divided by its images: SmolVLM, Idefics3, Gemma 3,
LLaVA, PaliGemma), or given by its grid (Qwen2-VL's `grid_thw`: t*h*w patches, merged by spatial_merge_size^2
into tokens). Nothing here depends on how many images or patches happen to match any other size.

The layout (core/layout.py) enters a tower's scope around the forward of each module returned by
`tower_modules`, with the maps `example_maps` computes from that call's arguments: {rows: example of each row}
for the images (dim 0 of a (M, P, D) input) and, for Qwen2-VL, for the patches and the merged patches.
"""

import torch

# children of a vision-language model (the module with get_image_features) that run on its images' rows
TOWER_CHILDREN = (
    "visual",
    "vision_tower",
    "vision_model",
    "multi_modal_projector",
    "connector",
    "vision_projection",
    "mm_projector",
    "visual_embeddings_table",  # Ovis2: the tower's soft tokens (images, patches, V) times an embedding table
)
IMAGE_TOKEN = ("image_token_id", "image_token_index")
VIDEO_TOKEN = ("video_token_id", "video_token_index")


def tower_modules(model):
    """[(module, name, config)] of the towers of the vision-language models in `model` (config: the VLM's)."""
    found, seen = [], set()
    for owner in model.modules():
        if not callable(getattr(owner, "get_image_features", None)):
            continue
        config = getattr(owner, "config", None)
        if _token_id(config, video=False) is None:  # no image tokens: its images are its examples (CLIP, SigLIP)
            continue
        for name in TOWER_CHILDREN:
            child = owner._modules.get(name)
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append((child, f"{type(owner).__name__}.{name}", config))
    return found


def _token_id(config, video):
    for name in VIDEO_TOKEN if video else IMAGE_TOKEN:
        found = getattr(config, name, None)
        if isinstance(found, int):
            return found
    return None


def _grid(args, kwargs):
    found = kwargs.get("grid_thw")
    if isinstance(found, torch.Tensor):
        return found
    return next(
        (
            a
            for a in args[1:]
            if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[-1] == 3 and not a.is_floating_point()
        ),
        None,
    )


def example_maps(config, args, kwargs, root):
    """({rows: (rows,) the example of each}, None) for a tower called with (args, kwargs) in a forward of the
    model called with keyword arguments `root`; (None, why) when the examples of its images cannot be told."""
    images = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    ids = root.get("input_ids")
    if images is None:
        return None, "it was called without images"
    if not isinstance(ids, torch.Tensor):
        return None, "the model was called without input_ids, whose image tokens say which example each image fills"
    grid = _grid(args, kwargs)
    video = (grid is not None and grid is root.get("video_grid_thw")) or images is root.get("pixel_values_videos")
    token = _token_id(config, video)
    if token is None:
        return None, f"its config names no {'video' if video else 'image'} token id"
    example_of_token = (ids == token).nonzero()[:, 0]  # the example of each image token, in the order they are filled
    total = example_of_token.numel()
    if grid is not None:
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1
        patches = grid.long().prod(-1)
        tokens = patches // merge**2
        if int(tokens.sum()) != total:
            return None, f"its images make {int(tokens.sum())} tokens, but input_ids holds {total} of theirs"
        example_of_image = example_of_token[torch.cumsum(tokens, 0) - tokens]
        return {
            int(patches.sum()): example_of_image.repeat_interleave(patches),
            total: example_of_image.repeat_interleave(tokens),
        }, None
    count = images.shape[0]
    assumed = (
        f"each of the {count} images on dim 0 of its input {tuple(images.shape)} is taken to fill an equal share of "
        f"input_ids' {total} image tokens (their sizes are read from a grid_thw argument only)"
    )
    if count == 0 or total % count:
        return None, f"{assumed}, which {total} tokens cannot give: its images fill unequal numbers of tokens"
    example_of_image = example_of_token[:: total // count]
    crossing = (example_of_token.view(count, -1) != example_of_image.unsqueeze(1)).any(1).nonzero()
    if crossing.numel():
        j = int(crossing[0])
        examples = sorted(set(example_of_token.view(count, -1)[j].tolist()))
        return None, (
            f"{assumed} ({total // count} each), and image {j}'s share would lie in examples {examples}: its images "
            "fill unequal numbers of tokens, or one row holds several images' patches"
        )
    return {count: example_of_image}, None
