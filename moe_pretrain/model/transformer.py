"""The full model: embedding (+ image tokens from the vision tower) -> hybrid KDA / gated-MLA layers with
AttnRes -> head.

Shape legend: B batch, T positions, D hidden, V vocab.

AttnRes bookkeeping (docs/model.md): the bank holds b_0 = the embedding output and one summed entry per
completed block of `block_size` layers; `partial` is the running sum of sublayer outputs inside the
current block (None right after a block closes). Each sublayer reads a mix of bank + partial instead
of the residual stream; a final mix feeds the last norm. Layers live in a ModuleDict keyed by global
index, so a pipeline stage can keep a subset and keep the global parameter names.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.data.patches import PlacedImage
from moe_pretrain.model.attn_res import AttnResMix
from moe_pretrain.model.balancing import reduce_pending
from moe_pretrain.model.decoder_layer import DecoderLayer
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.image_merge import ImageMerge
from moe_pretrain.model.init import Normal
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.mlp import SiTUGLUMLP
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.model.mtp import MTPBlock, tokens_ahead
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.router import Router
from moe_pretrain.model.saved_inputs import SavedInputs, SavedInputsPolicy
from moe_pretrain.model.vision_tower import VisionProjector, VisionTower


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels = REFERENCES):
        """kernels: the implementations every module runs (gpu_kernels/choice.py; the references by default)."""
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        """What the modules were built with; its why_not notes feed the start-up report (gpu_kernels/fast_paths.py)."""
        d = cfg.hidden_size
        self.embedding = nn.Embedding(cfg.vocab_size, d, _weight=torch.empty(cfg.vocab_size, d))
        self.embedding.param_init = {"weight": Normal(cfg.init_std)}
        vision = cfg.vision
        self.vision_tower = VisionTower(vision.encoder, vision.patch_size, vision.channels, cfg.init_std, kernels)
        self.mm_projector = VisionProjector(vision.encoder.merged_size, d, cfg.norm_eps, cfg.init_std, kernels)
        self.image_merge = ImageMerge()
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, kernels) for i in range(cfg.num_layers)})
        self.final_mix = AttnResMix(d, cfg.norm_eps, kernels)
        self.final_norm = RMSNorm(d, cfg.norm_eps, kernels)
        self.head = make_linear(d, cfg.vocab_size, init_std=cfg.init_std)
        self.mtp = nn.ModuleDict({str(k): MTPBlock(cfg, k + 1, kernels) for k in range(cfg.mtp.layers)})
        """The multi-token-prediction blocks (model/mtp.py), after the head on the last pipeline stage."""

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        patches: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        images: list[PlacedImage] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T]; doc_ids [B, T] (packed documents, default one per row); patches [P, patch_dim] of
        these images (host integers: row, first position, (t, h, w) grid), in row-major order: each image's
        (h/m)(w/m) tokens go to its positions, which image_mask [B, T] marks.
        -> (logits [B, T, V] (V / tp with tensor parallelism; T / cp, this rank's positions, with context
        parallelism), summed balancing loss (0 unless moe.balancing = aux_loss))."""
        _, bank, partial, balance_loss = self.backbone(tokens, doc_ids, patches, image_mask, images)
        return self.logits(bank, partial), balance_loss

    def forward_with_mtp(self, tokens: torch.Tensor, *inputs) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """forward's inputs -> (logits, each multi-token-prediction block's logits (the same shape), summed
        balancing loss of the backbone and the blocks): the training forward when model.mtp.layers > 0."""
        layout, bank, partial, balance_loss = self.backbone(tokens, *inputs)
        logits, ahead, mtp_loss = self.logits_with_mtp(bank, partial, self.embed_ahead(tokens), layout)
        return logits, ahead, balance_loss + mtp_loss

    def backbone(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, patches: torch.Tensor | None = None,
                 image_mask: torch.Tensor | None = None, images: list[PlacedImage] | None = None
                 ) -> tuple[DocumentLayout, list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """Embeddings and every layer: (layout, AttnRes bank, partial block sum, summed balancing loss)."""
        layout = self.layout(tokens, doc_ids)
        x = self.embed(tokens, patches, image_mask, images)
        return layout, *self.run_layers([x], None, layout)

    def layout(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None) -> DocumentLayout:
        """The documents of tokens [B, T]: doc_ids [B, T], or one per row."""
        B, T = tokens.shape
        if doc_ids is None:
            return DocumentLayout.single_documents(B, T, tokens.device, self.kernels.host)
        return DocumentLayout.from_doc_ids(doc_ids, self.kernels.host)

    def embed(self, tokens: torch.Tensor, patches: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
              images: list[PlacedImage] | None = None) -> torch.Tensor:
        """Token embeddings with image tokens in place: b_0, the first bank entry. tokens, image_mask [B, T],
        patches and images cover every position; the result holds the positions this rank holds (the
        parallel set-up places the embedding's input and output and swaps the image merge:
        parallel/activation_plan.py)."""
        x = self.embedding(tokens)
        if torch.is_autocast_enabled(x.device.type):
            # b_0 in the compute dtype, as the sublayers' outputs are: the bank is then one dtype, and so is every
            # mix of it, the pre-norms and what follows (an fp32 b_0 made them all fp32, each cast again)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if patches is None or not patches.shape[0]:  # a batch without images may pass [0, patch_dim]
            return x
        if image_mask is None or not images:
            raise ValueError("forward: patches need their images' placements and an image_mask marking their tokens")
        # Every rank that shares the rows sends in one dtype: the embeddings' (the projector's may be autocast's).
        return self.image_merge(x, image_mask, images, self.cfg.vision.encoder.merge,
                                lambda which: self.encode_images(patches, images, which, x.dtype))

    def encode_images(self, patches: torch.Tensor, images: list[PlacedImage], which: list[int],
                      dtype: torch.dtype) -> torch.Tensor:
        """The tokens [n, D] in `dtype` of images `which` (indices into images, in order): tower, projector."""
        weight = self.vision_tower.patch_embed.proj.weight  # the patches may lie in host memory (data.Batch.to)
        if not which:  # [0, D], requiring grad: this rank's backward must still run the exchange's collectives
            return weight.new_zeros(0, self.cfg.hidden_size, dtype=dtype).requires_grad_(torch.is_grad_enabled())
        first = [0]
        for image in images:
            first.append(first[-1] + image.patches)
        mine = torch.cat([patches[first[i]:first[i + 1]] for i in which]).to(weight.device, weight.dtype)
        return self.mm_projector(self.vision_tower(mine, [images[i].grid for i in which])).to(dtype)

    def run_layers(self, bank: list[torch.Tensor], partial: torch.Tensor | None, layout: DocumentLayout
                   ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """Run the layers this module holds (all, or a pipeline stage's) over the AttnRes state."""
        balance_loss = bank[0].new_zeros((), dtype=torch.float32)
        block = self.cfg.attn_res.block_size
        for name, layer in self.layers.items():
            partial, layer_loss = layer(bank, partial, layout)
            if layer_loss is not None:
                balance_loss = balance_loss + layer_loss
            if (int(name) + 1) % block == 0:
                bank, partial = [*bank, partial], None
        return bank, partial, balance_loss

    def logits(self, bank: list[torch.Tensor], partial: torch.Tensor | None) -> torch.Tensor:
        """Final AttnRes mix, norm and output head."""
        h = self.final_mix(bank if partial is None else [*bank, partial])
        return self.head(self.final_norm(h))

    def embed_ahead(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The embeddings the multi-token-prediction blocks read, e_{t+k} for block k: [B, T, D] each (this
        rank's positions), from the tokens [B, T] of every position."""
        return [self.embedding(tokens_ahead(tokens, k)) for k in range(1, self.cfg.mtp.layers + 1)]

    def logits_with_mtp(self, bank: list[torch.Tensor], partial: torch.Tensor | None, ahead: list[torch.Tensor],
                        layout: DocumentLayout) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """logits(), and the blocks' logits through the shared head from the same final mix (h_0), with
        their summed balancing loss."""
        hidden = self.final_mix(bank if partial is None else [*bank, partial])
        logits = self.head(self.final_norm(hidden))
        balance_loss = hidden.new_zeros((), dtype=torch.float32)
        predicted = []
        for block, embedded in zip(self.mtp.values(), ahead, strict=True):
            hidden, block_loss = block(hidden, embedded.to(hidden.dtype), layout)
            if block_loss is not None:
                balance_loss = balance_loss + block_loss
            predicted.append(self.head(block.norm(hidden)))
        return logits, predicted, balance_loss

    @classmethod
    def stage_of(cls, full: "MoETransformer", layers: list[int], *, first: bool, last: bool) -> "MoETransformer":
        """A pipeline stage's view of `full`: the given layers (global indices kept), the embeddings when
        first, the final mix, norm and head when last. Modules are shared with `full`, not copied."""
        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        stage.cfg, stage.kernels = full.cfg, full.kernels
        stage.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in layers})
        for name in ("embedding", "vision_tower", "mm_projector", "image_merge") if first else ():
            setattr(stage, name, getattr(full, name))
        for name in ("final_mix", "final_norm", "head", "mtp") if last else ():
            setattr(stage, name, getattr(full, name))
        return stage

    def set_recompute(self, mode: str, saved_inputs: SavedInputsPolicy = "device",
                      exchanges: bool = True) -> SavedInputs:
        """What backward recomputes (model/recompute.py), on the layers this module holds, whether full
        recomputation repeats the expert exchanges, and where it keeps the layers' inputs
        (model/saved_inputs.py): one store for them all, returned."""
        store = SavedInputs(saved_inputs)
        modules = recompute_modules(mode)
        if hasattr(self, "vision_tower"):  # a pipeline's first stage, or the whole model
            # The modules name the backbone's parts; the tower's blocks are re-run whole under any recomputation:
            # at full size they are under 0.5% of the step's FLOPs and the first stage's largest activations.
            self.vision_tower.encoder.recompute = mode != "none"
        for layer in self.decoder_layers().values():
            layer.saved_inputs = store
            layer.recompute = mode == "full"
            layer.recompute_modules = modules & {"attn_res", "norms"}
            layer.mixer.set_recompute(modules)
            if isinstance(layer.mlp, LatentMoE):
                layer.mlp.recompute_experts = "experts" in modules
                layer.mlp.recompute_around_exchanges = mode == "full" and not exchanges
            for module in layer.mlp.modules():
                if isinstance(module, (SiTUGLUMLP, GroupedExperts)):
                    # Inside the experts' own region their activation is recomputed with them (the region's
                    # checkpoint hooks would hide any nested inside it).
                    inside = isinstance(module, GroupedExperts) and "experts" in modules
                    module.recompute_act = "expert_act" in modules and not inside
        return store

    def decoder_layers(self) -> dict[int, DecoderLayer]:
        """Every decoder layer this module holds by global index: the backbone's, then the multi-token-prediction
        blocks' (num_layers + k - 1 for block k, on the last stage)."""
        layers = {int(name): layer for name, layer in self.layers.items()}
        for block in getattr(self, "mtp", {}).values():
            layers[block.layer.index] = block.layer
        return layers

    def routers(self) -> dict[int, Router]:
        """The router of every MoE layer, by global layer index (the multi-token-prediction blocks' included)."""
        return {index: layer.mlp.router for index, layer in self.decoder_layers().items()
                if isinstance(layer.mlp, LatentMoE)}

    def discard_balancing(self) -> None:
        """Drop the current step's balancing statistics (the step was skipped)."""
        for router in self.routers().values():
            router.discard_step()

    def update_balancing(self) -> None:
        """Move every router's bias by its balancer (call after each optimizer step); the layers' histograms are
        reduced together first (one collective for the stage)."""
        routers = self.routers().values()
        reduce_pending([router.balancer for router in routers])
        for router in routers:
            router.update_bias()
