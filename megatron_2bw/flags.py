"""The one table of the trainer's flags: Megatron-LM's names, argparse types, defaults, help, and the config field
each sets.

``megatron_2bw.cli`` derives the parser, the flags -> config mapping and the printed commands from
``FLAGS``; nothing else lists a flag. Plain data: no torch, no process group.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import (
    ATTENTION_BACKENDS,
    CKPT_FORMATS,
    COMPENSATIONS,
    CP_COMM_TYPES,
    DECAY_STYLES,
    MUON_ADJUST_LR_FNS,
    NORMALIZATIONS,
    OPTIMIZERS,
    P2P_MODES,
    POSITION_EMBEDDING_TYPES,
)
from .config.moe import (
    DISPATCHER_TYPES,
    DROP_POLICIES,
    LOAD_BALANCING_TYPES,
    ROUTER_DTYPES,
    SCORE_FUNCTIONS,
    format_moe_layer_freq,
    parse_moe_layer_freq,
)
from .config.presets import GPT2_VOCAB, PRESETS
from .schedule.schedules import SCHEDULE_NAMES
from .schedule.stages import format_split, parse_split
from .yaml_cfg import YAML_FLAG

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("gloo", "nccl")
KINDS = ("gpt", "bert")
MEGATRON_DROPOUT = 0.1  # without a preset, Megatron's dropout

@dataclass(frozen=True)
class Flag:
    """One flag: how argparse reads it and which config field(s) it sets (``None``: read by a rule)."""

    name: str
    target: str | tuple[str, ...] | None
    group: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    help: str | None = None
    choices: tuple[str, ...] | None = None
    const: Any = None  # a switch (store_true) that sets its target to ``const``
    alias: bool = False  # an older spelling: parsed, never printed
    nargs: str | None = None
    required: bool = False
    kinds: tuple[str, ...] = KINDS
    metavar: str | None = None
    show: Callable[[Any], str] | None = None  # how a value is written back as one token (default: str per item)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def targets(self) -> tuple[str, ...]:
        return () if self.target is None else (self.target,) if isinstance(self.target, str) else self.target

    def add_to(self, group: argparse._ActionsContainer) -> None:
        if self.const is not None:
            group.add_argument(self.name, action="store_true", help=self.help)
            return
        kw = {"type": self.type, "default": self.default, "choices": self.choices, "nargs": self.nargs,
              "metavar": self.metavar}
        group.add_argument(self.name, help=self.help, required=self.required,
                           **{k: v for k, v in kw.items() if v is not None})


MODEL = "model (a --model-preset gives defaults; explicit flags override it)"
PAR, TRAIN = "parallelism and pipeline", "training"
OPT, DATA = "optimizer, learning rate and precision", "data and tokenizer"
CKPT, LOG, SYS = "checkpoints", "logging and evaluation", "system"
_PRESET_HELP = f"named model shape: {', '.join(PRESETS)}"
_DROPOUT_HELP = f"default {MEGATRON_DROPOUT} (a preset's value with --model-preset)"
_EXIT_HELP = "on SIGTERM or --exit-signal: save (with --save) at the next step boundary and exit 0"
_DURATION_HELP = "save (with --save) and exit 0 at the first step boundary after this many minutes"
_SKIP_HELP = "exit 3 after more consecutive skipped steps (default: fp16 20, constant --loss-scale 5, else 0)"
_WANDB_HELP = ("turns wandb logging on (offline unless WANDB_MODE/WANDB_API_KEY say otherwise; "
               "pip install -e '.[wandb]')")

# ---- Mixture of experts (issue 42): Megatron-Core's flags; every default is MoEConfig's (config/moe.py), so a flag
# not given is None here and --num-experts absent is the dense model. Values Megatron has that are not built here
# (flex, sinkhorn, global_aux_loss, an expert-tensor-parallel size other than 1) parse and are refused in one line.
MOE = "mixture of experts (Megatron-Core's flags; GPT)"
_GPT = ("gpt",)
MOE_FLAGS: tuple[Flag, ...] = (
    Flag("--num-experts", "moe.num_experts", MOE, int, kinds=_GPT, help="experts per MoE layer (absent: dense)"),
    Flag("--moe-ffn-hidden-size", "moe.moe_ffn_hidden_size", MOE, int, kinds=_GPT,
         help="each expert's FFN size (default --ffn-hidden-size)"),
    Flag("--moe-layer-freq", "moe.moe_layer_freq", MOE, parse_moe_layer_freq, kinds=_GPT, show=format_moe_layer_freq,
         help="MoE every N layers (default 1), or one 0/1 per layer: ([0]*3+[1]*5)"),
    Flag("--moe-router-topk", "moe.moe_router_topk", MOE, int, kinds=_GPT, help="experts per token (default 2)"),
    Flag("--moe-router-score-function", "moe.moe_router_score_function", MOE, choices=SCORE_FUNCTIONS, kinds=_GPT,
         help="softmax (default) or sigmoid"),
    Flag("--moe-router-pre-softmax", "moe.moe_router_pre_softmax", MOE, const=True, kinds=_GPT,
         help="softmax over all experts before top-k (not renormalised)"),
    Flag("--moe-router-num-groups", "moe.moe_router_num_groups", MOE, int, kinds=_GPT,
         help="expert groups for group-limited routing"),
    Flag("--moe-router-group-topk", "moe.moe_router_group_topk", MOE, int, kinds=_GPT, help="groups chosen per token"),
    Flag("--moe-router-topk-scaling-factor", "moe.moe_router_topk_scaling_factor", MOE, float, kinds=_GPT,
         help="multiplies the routing weights"),
    Flag("--moe-router-dtype", "moe.moe_router_dtype", MOE, choices=ROUTER_DTYPES, kinds=_GPT,
         help="routing in fp32 or fp64 (default: the input's dtype)"),
    Flag("--moe-router-load-balancing-type", "moe.moe_router_load_balancing_type", MOE,
         choices=LOAD_BALANCING_TYPES + ("sinkhorn", "global_aux_loss"), kinds=_GPT, help="default aux_loss"),
    Flag("--moe-aux-loss-coeff", "moe.moe_aux_loss_coeff", MOE, float, kinds=_GPT, help="default 0"),
    Flag("--moe-z-loss-coeff", "moe.moe_z_loss_coeff", MOE, float, kinds=_GPT, help="default: no z-loss"),
    Flag("--moe-router-enable-expert-bias", "moe.moe_router_enable_expert_bias", MOE, const=True, kinds=_GPT,
         help="aux-loss-free balancing: a per-expert bias on the sigmoid scores, updated every step"),
    Flag("--moe-router-bias-update-rate", "moe.moe_router_bias_update_rate", MOE, float, kinds=_GPT,
         help="default 1e-3"),
    Flag("--moe-token-dispatcher-type", "moe.moe_token_dispatcher_type", MOE, choices=DISPATCHER_TYPES + ("flex",),
         kinds=_GPT, help="allgather (default) or alltoall"),
    Flag("--moe-expert-capacity-factor", "moe.moe_expert_capacity_factor", MOE, float, kinds=_GPT,
         help="drop tokens over this capacity (default: dropless)"),
    Flag("--moe-token-drop-policy", "moe.moe_token_drop_policy", MOE, choices=DROP_POLICIES, kinds=_GPT,
         help="probs (default) or position"),
    Flag("--moe-pad-expert-input-to-capacity", "moe.moe_pad_expert_input_to_capacity", MOE, const=True, kinds=_GPT),
    Flag("--moe-shared-expert-intermediate-size", "moe.moe_shared_expert_intermediate_size", MOE, int, kinds=_GPT,
         help="FFN size of all shared experts together (default: none)"),
    Flag("--moe-shared-expert-gate", "moe.moe_shared_expert_gate", MOE, const=True, kinds=_GPT,
         help="sigmoid gate on the shared experts (Qwen2-MoE)"),
    Flag("--moe-shared-expert-overlap", "moe.moe_shared_expert_overlap", MOE, const=True, kinds=_GPT,
         help="run the shared experts while the dispatch all-to-all is in flight (alltoall dispatcher)"),
    Flag("--moe-grouped-gemm", "moe.moe_grouped_gemm", MOE, const=True, kinds=_GPT,
         help="torch._grouped_mm for the experts where it runs"),
    Flag("--expert-model-parallel-size", "moe.expert_model_parallel_size", MOE, int, kinds=_GPT,
         help="ranks the experts are spread over, inside data x context (default 1)"),
    Flag("--expert-tensor-parallel-size", "moe.expert_tensor_parallel_size", MOE, int, kinds=_GPT,
         help="only 1 (experts are not sharded over the tensor group)"),
    Flag("--moe-layer-recompute", "moe.moe_layer_recompute", MOE, const=True, kinds=_GPT,
         help="recompute the MoE layers in backward"),
)

FLAGS: tuple[Flag, ...] = (
    Flag("--model-preset", None, MODEL, help=_PRESET_HELP),
    Flag("--num-layers", "model.num_layers", MODEL, int),
    Flag("--hidden-size", "model.hidden_size", MODEL, int),
    Flag("--ffn-hidden-size", "model.ffn_hidden_size", MODEL, int, help="default 4 * hidden size"),
    Flag("--num-attention-heads", "model.num_attention_heads", MODEL, int),
    Flag("--seq-length", "model.seq_length", MODEL, int),
    Flag("--max-position-embeddings", "model.max_position_embeddings", MODEL, int, help="default: the sequence length"),
    Flag("--hidden-dropout", "model.hidden_dropout", MODEL, float, help=_DROPOUT_HELP),
    Flag("--attention-dropout", "model.attention_dropout", MODEL, float, help=_DROPOUT_HELP),
    Flag("--layernorm-epsilon", "model.layernorm_epsilon", MODEL, float),
    Flag("--init-method-std", "model.init_method_std", MODEL, float),
    # Llama-family layers (Megatron-Core's names; GPT only)
    Flag("--position-embedding-type", "model.position_embedding_type", MODEL, choices=POSITION_EMBEDDING_TYPES,
         help="learned_absolute (default) or rope (rotary, rotate-half convention)"),
    Flag("--rotary-base", "model.rotary_base", MODEL, int, help="RoPE base (default 10000; Llama 3: 500000)"),
    Flag("--rotary-percent", "model.rotary_percent", MODEL, float, help="fraction of each head rotated (default 1.0)"),
    Flag("--swiglu", "model.swiglu", MODEL, const=True, help="SiLU-gated MLP (ffn default: 2/3 of 4h, multiple of 64)"),
    Flag("--normalization", "model.normalization", MODEL, choices=NORMALIZATIONS,
         help="LayerNorm (default) or RMSNorm"),
    Flag("--group-query-attention", "model.group_query_attention", MODEL, const=True,
         help="grouped-query attention (with --num-query-groups)"),
    Flag("--num-query-groups", "model.num_query_groups", MODEL, int,
         help="key/value heads with --group-query-attention"),
    Flag("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights", MODEL, const=True,
         help="a separate output layer instead of the word embedding"),
    Flag("--disable-bias-linear", "model.add_bias_linear", MODEL, const=False, help="no biases in the linear layers"),
    *MOE_FLAGS,
    Flag("--sequence-parallel", "model.sequence_parallel", PAR, const=True,
         help="t > 1: norms, dropout and the residual stream sharded along the sequence (GPT)"),
    Flag("--tensor-model-parallel-size", "parallel.tensor", PAR, int, 1),
    Flag("--pipeline-model-parallel-size", "parallel.pipeline", PAR, int, 1),
    Flag("--context-parallel-size", "parallel.context", PAR, int, 1,
         help="ranks each sequence is sharded over (attention exchanges keys and values; Megatron's rank order "
              "tensor, context, data, pipeline)"),
    Flag("--cp-comm-type", "parallel.cp_comm_type", PAR, choices=CP_COMM_TYPES,
         help="context parallelism's key/value exchange: p2p (a ring, overlapped with the attention of the "
              "blocks at hand; default), all_gather (the whole sequence's keys and values, then one fused "
              "attention per local chunk) or a2a (all-to-all: 1/c of the heads over the whole sequence; heads and "
              "key/value groups per tensor rank divisible by c)"),
    Flag("--pipeline-layer-split", "pipeline.layer_split", PAR, parse_split, metavar="N,N,...", show=format_split,
         help="layers of each stage, first to last (summing to --num-layers; 0 allowed on the first and last)"),
    Flag("--decoder-first-pipeline-num-layers", None, PAR, int, help="layers of the first stage (Megatron)"),
    Flag("--decoder-last-pipeline-num-layers", None, PAR, int, help="layers of the last stage (Megatron)"),
    Flag("--account-for-embedding-in-pipeline-split", None, PAR, const=True, help="embedding = one layer (Megatron)"),
    Flag("--account-for-loss-in-pipeline-split", None, PAR, const=True, help="head and loss = one layer (Megatron)"),
    Flag("--pipeline-schedule", "pipeline.schedule", PAR, choices=SCHEDULE_NAMES,
         help="default: 2bw with more than one pipeline stage, flush with one (where 2BW would only add a stale "
              "gradient and a second weight copy)"),
    Flag("--num-layers-per-virtual-pipeline-stage", None, PAR, int,
         help="layers of each model chunk (Megatron): v = num-layers / pipeline size / N chunks per rank, "
              "chunk c of rank r is virtual stage c*d + r; needs --pipeline-schedule interleaved-1f1b"),
    Flag("--virtual-pipeline-model-parallel-size", "pipeline.virtual_stages", PAR, int,
         help="model chunks per rank (Megatron; interleaved-1f1b, default 2 there)"),
    Flag("--enable-optimizer-post-validation", "pipeline.post_validation", PAR, const=True,
         help="zb-h1 / zb-h2 / zb-v: apply each update speculatively (as if it neither clips nor overflows) so the "
              "next step's warm-up overlaps this step's tail, check it against the global norm a few forwards later, "
              "and roll back and redo the warm-up where it was wrong (Qi et al. 2024; the Zero Bubble fork's flag)"),
    Flag("--p2p-mode", "pipeline.p2p_mode", PAR, choices=P2P_MODES, default="auto",
         help="stage-to-stage transfers: prefetch (receives posted ahead; gloo), grouped (batch_isend_irecv "
              "per peer, as NCCL requires) or auto (grouped except on gloo)"),
    Flag("--2bw-compensation", "pipeline.compensation", PAR, choices=COMPENSATIONS + ("auto",), default="auto",
         help="2BW's stale gradient: auto (default: ef with Muon, predict with Adam/SGD-momentum in bf16/fp16 "
              "without the distributed optimizer, else none; config.resolve_compensation), none, predict (run on "
              "predicted weights; fp32: +1 weight copy), dc (DC-ASGD), "
              "ef (Zmushko et al. 2026's error feedback on the updates, D_t + gamma * (D_t - D_{t-1}); any "
              "optimizer; +4 bytes per parameter) or extrapolate (g_t + gamma * (g_t - g_{t-1}); +4 bytes)"),
    Flag("--2bw-dc-lambda", "pipeline.dc_lambda", PAR, float, 0.04, help="dc: g + lambda * g * g * (W(t) - W(t-1))"),
    Flag("--2bw-ef-scale", "pipeline.ef_scale", PAR, float, 1.0,
         help="gamma of ef (D_t + gamma * (D_t - D_{t-1})) and of extrapolate"),
    Flag("--pipeline-no-flushes", "pipeline.schedule", PAR, const="2bw", alias=True,
         help="2021 spelling of --pipeline-schedule 2bw"),
    Flag("--gpipe", "pipeline.schedule", PAR, const="gpipe", alias=True,
         help="2021 spelling of --pipeline-schedule gpipe"),
    Flag("--micro-batch-size", "pipeline.micro_batch_size", PAR, int, help="required unless --auto-plan"),
    Flag("--auto-plan", None, PAR, const=True,
         help="let the planner choose t, d, --micro-batch-size, recomputation and the schedule"),
    Flag("--auto-plan-profile", None, PAR, help="profile JSON to plan from (written here by a single-process run)"),
    Flag("--cluster", None, PAR, help="--auto-plan: cluster preset or JSON file (default: describe this machine)"),
    Flag("--global-batch-size", "training.global_batch_size", PAR, int,
         help="default: micro batch size x data-parallel size x pipeline stages (d microbatches per step, "
              "the fewest PipeDream-2BW allows)"),
    Flag("--recompute-activations", "pipeline.recompute", PAR, const=True, help="re-run whole stages in backward"),
    Flag("--checkpoint-activations", "pipeline.recompute", PAR, const=True, alias=True,
         help="old spelling of --recompute-activations"),
    Flag("--recompute-granularity", "pipeline.recompute_granularity", PAR, choices=("full", "selective"),
         help="recompute inside stages: full layers (with --recompute-method) or the attention core only"),
    Flag("--recompute-method", "pipeline.recompute_method", PAR, choices=("uniform", "block")),
    Flag("--recompute-num-layers", "pipeline.recompute_num_layers", PAR, int,
         help="uniform: chunk size; block: layers"),
    Flag("--train-iters", "training.train_iters", TRAIN, int, help="required unless --train-samples"),
    Flag("--train-samples", "training.train_samples", TRAIN, int,
         help="train on this many samples instead: --train-samples // --global-batch-size iterations (Megatron)"),
    Flag("--seed", "training.seed", TRAIN, int, 1234),
    Flag("--exit-interval", "training.exit_interval", TRAIN, int,
         help="save (with --save) and exit after this many iterations"),
    Flag("--exit-signal-handler", "training.exit_signal_handler", TRAIN, const=True, help=_EXIT_HELP),
    Flag("--no-exit-signal-handler", None, TRAIN, const=True,
         help="SIGTERM/SIGHUP/--exit-signal end the process at once (default: save at the next boundary and exit 0)"),
    Flag("--exit-signal", "training.exit_signal", TRAIN, default="SIGUSR1", help="handled like SIGTERM"),
    Flag("--exit-duration-in-mins", "training.exit_duration_in_mins", TRAIN, float, help=_DURATION_HELP),
    Flag("--max-skipped-steps", "training.max_skipped_steps", TRAIN, int, help=_SKIP_HELP),
    Flag("--optimizer", "optimizer.optimizer", OPT, choices=OPTIMIZERS, default="adam",
         help="adam (AdamW), sgd, or muon (Muon on the transformer's linear weights, AdamW on the rest)"),
    Flag("--lr", ("optimizer.lr", "lr.lr"), OPT, float, required=True),
    Flag("--min-lr", "lr.min_lr", OPT, float, 0.0),
    Flag("--lr-decay-style", "lr.decay_style", OPT, choices=DECAY_STYLES, default="linear"),
    Flag("--lr-decay-iters", "lr.decay_iters", OPT, int, help="default: --train-iters"),
    Flag("--lr-warmup-iters", "lr.warmup_iters", OPT, int, 0),
    Flag("--lr-warmup-fraction", None, OPT, float, help="warm-up as a fraction of --lr-decay-iters"),
    Flag("--lr-decay-samples", None, OPT, int,
         help="with --train-samples: decay over this many samples (default: all)"),
    Flag("--lr-warmup-samples", None, OPT, int, help="with --train-samples: warm up over this many samples"),
    Flag("--weight-decay", "optimizer.weight_decay", OPT, float, 0.01),
    Flag("--clip-grad", "optimizer.clip_grad", OPT, float, 1.0),
    Flag("--adam-beta1", "optimizer.adam_beta1", OPT, float, 0.9),
    Flag("--adam-beta2", "optimizer.adam_beta2", OPT, float, 0.999),
    Flag("--adam-eps", "optimizer.adam_eps", OPT, float, 1e-8),
    Flag("--sgd-momentum", "optimizer.sgd_momentum", OPT, float, 0.9),
    Flag("--muon-momentum", "optimizer.muon_momentum", OPT, float, 0.95, help="muon: momentum of the matrices"),
    Flag("--muon-nesterov", "optimizer.muon_nesterov", OPT, const=True, help="muon: Nesterov momentum (the default)"),
    Flag("--no-muon-nesterov", "optimizer.muon_nesterov", OPT, const=False, help="muon: plain momentum"),
    Flag("--muon-use-nesterov", "optimizer.muon_nesterov", OPT, const=True, alias=True,
         help="Megatron-LM's spelling of --muon-nesterov"),
    Flag("--muon-ns-steps", "optimizer.muon_ns_steps", OPT, int, 5, help="muon: Newton-Schulz iterations"),
    Flag("--muon-num-ns-steps", "optimizer.muon_ns_steps", OPT, int, alias=True,
         help="Megatron-LM's spelling of --muon-ns-steps"),
    Flag("--muon-lr", "optimizer.muon_lr", OPT, float,
         help="muon: the matrices' peak learning rate, scheduled like --lr (default: --lr)"),
    Flag("--muon-adjust-lr-fn", "optimizer.muon_adjust_lr_fn", OPT, choices=MUON_ADJUST_LR_FNS, default="original",
         help="muon: shape scale of the matrices' step, as torch.optim.Muon's adjust_lr_fn"),
    Flag("--fp16", "optimizer.dtype", OPT, const="fp16"),
    Flag("--bf16", "optimizer.dtype", OPT, const="bf16"),
    Flag("--loss-scale", "optimizer.loss_scale", OPT, float, help="fp16: a constant loss scale (default: dynamic)"),
    Flag("--initial-loss-scale", "optimizer.initial_loss_scale", OPT, float, 2.0**16),
    Flag("--loss-scale-window", "optimizer.loss_scale_window", OPT, int, 1000),
    Flag("--min-loss-scale", "optimizer.min_loss_scale", OPT, float, 1.0),
    Flag("--accumulate-allreduce-grads-in-fp32", "optimizer.accumulate_allreduce_grads_in_fp32", OPT, const=True,
         help="accumulate and all-reduce gradients in fp32 (the default with --bf16)"),
    Flag("--grad-reduce-in-bf16", "optimizer.accumulate_allreduce_grads_in_fp32", OPT, const=False,
         help="--bf16: accumulate and all-reduce gradients in bf16 instead of fp32"),
    Flag("--use-distributed-optimizer", "optimizer.use_distributed_optimizer", OPT, const=True,
         help="shard the fp32 master weights and optimizer state over the data-parallel group (ZeRO-1)"),
    Flag("--data-path", "data.data_path", DATA, nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... (a blend)"),
    Flag("--split", "data.split", DATA, default="969, 30, 1", help="train,valid,test document weights"),
    Flag("--tokenizer-type", "data.tokenizer_type", DATA,
         help="SentencePieceTokenizer, GPT2BPETokenizer, BertWordPiece(Lower)Case, HuggingFaceTokenizer"),
    Flag("--tokenizer-model", "data.tokenizer_model", DATA),
    Flag("--vocab-file", "data.vocab_file", DATA),
    Flag("--merge-file", "data.merge_file", DATA),
    Flag("--mask-prob", "data.mask_prob", DATA, float, 0.15, kinds=("bert",)),
    Flag("--short-seq-prob", "data.short_seq_prob", DATA, float, 0.1, kinds=("bert",)),
    Flag("--save", "training.save", CKPT, help="checkpoint directory to write"),
    Flag("--load", "training.load", CKPT, help="checkpoint directory to resume from"),
    Flag("--override-resumed-settings", "training.override_resumed_settings", CKPT, const=True,
         help="resume although data or schedule settings differ from the checkpoint's (each change is logged)"),
    Flag("--overwrite-save", "training.overwrite_save", CKPT, const=True,
         help="start over in a --save that holds another run's checkpoints: delete them first (default: refused)"),
    Flag("--save-interval", "training.save_interval", CKPT, int),
    Flag("--ckpt-format", "training.ckpt_format", CKPT, default="torch", choices=CKPT_FORMATS,
         help="torch: Megatron v2 files per (tensor, pipeline) rank; torch_dist: torch.distributed.checkpoint, "
              "every rank writes its shards, resumes at any layout (loading reads either format)"),
    Flag("--async-save", "training.async_save", CKPT, const=True,
         help="torch_dist: copy the state to host memory at the boundary and write it while training goes on"),
    Flag("--finetune", "training.finetune", CKPT, const=True,
         help="load the weights of --load only: iteration 0, a fresh optimizer, this run's data and schedule"),
    Flag("--no-load-optim", "training.no_load_optim", CKPT, const=True,
         help="resume the weights and the iteration of --load with a fresh optimizer and loss scaler"),
    Flag("--no-load-rng", "training.no_load_rng", CKPT, const=True, help="do not restore the RNG states of --load"),
    Flag("--skip-train", "training.skip_train", CKPT, const=True,
         help="evaluate the --load checkpoint on the validation and test sets, then exit"),
    Flag("--log-interval", "training.log_interval", LOG, int, 100),
    Flag("--eval-interval", "training.eval_interval", LOG, int, 1000),
    Flag("--eval-iters", "training.eval_iters", LOG, int, 100),
    Flag("--metrics-file", "training.metrics_file", LOG, help="append one JSON object per line (see docs/training.md)"),
    Flag("--tensorboard-dir", "training.tensorboard_dir", LOG,
         help="TensorBoard events (pip install -e '.[tensorboard]')"),
    Flag("--wandb-project", "training.wandb_project", LOG, help=_WANDB_HELP),
    Flag("--wandb-exp-name", "training.wandb_exp_name", LOG,
         help="the wandb run's name (required with --wandb-project)"),
    Flag("--wandb-save-dir", "training.wandb_save_dir", LOG,
         help="where wandb writes the run (default: <--save>/wandb)"),
    Flag("--device", "system.device", SYS, choices=DEVICES, default="auto"),
    Flag("--distributed-backend", "system.backend", SYS, choices=BACKENDS, help="default: nccl on CUDA, gloo on CPU"),
    Flag("--distributed-timeout-minutes", "system.timeout_minutes", SYS, float, 10.0),
    Flag("--fused-kernels", "system.fused_kernels", SYS, choices=("auto", "apex", "torch"), default="auto"),
    Flag("--attention-backend", "system.attention_backend", SYS, choices=ATTENTION_BACKENDS, default="auto",
         help="attention kernel (Megatron's): auto lets scaled_dot_product_attention pick; flash, fused: only its "
              "fused kernels (no s^2 tensor kept); unfused, local: softmax(QK^T) and dropout written out (the "
              "planner's memory model follows the choice)"),
    Flag("--stall-timeout-s", "system.stall_timeout_s", SYS, float, 45.0,
         help="exit 4 naming a rank stalled this long (0: off)"),
    Flag(YAML_FLAG, None, SYS, metavar="FILE",
         help="YAML mapping of flag names (train_iters or train-iters) to values; flags on the command line win"),
    Flag("--validate-only", None, SYS, const=True,
         help="check the flags, tokenizer, data and checkpoint to resume as every rank would, print one line "
              "(config OK: ... or error: ...) and exit 0 or 2 without starting a process group"),
    # ---- Megatron-LM flags of ported launch scripts (issue 19): data, schedule and checkpoint ones change
    # training as Megatron's do; the logging and kernel-choice ones say what they mean here.
    Flag("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", MODEL, int,
         help="pad the vocabulary to a multiple of this (default 128) x --tensor-model-parallel-size (Megatron; "
              "padded rows never win the softmax)"),
    Flag("--eod-mask-loss", "data.eod_mask_loss", DATA, const=True, kinds=("gpt",),
         help="no loss on the prediction made at an end-of-document token (Megatron)"),
    Flag("--reset-position-ids", "data.reset_position_ids", DATA, const=True, kinds=("gpt",),
         help="position ids restart at 0 after each end-of-document token (Megatron)"),
    Flag("--reset-attention-mask", "data.reset_attention_mask", DATA, const=True, kinds=("gpt",),
         help="attention does not cross end-of-document tokens (Megatron; a [b, s, s] mask per microbatch)"),
    Flag("--mock-data", "data.mock_data", DATA, const=True, kinds=("gpt",),
         help="synthetic documents instead of --data-path (Megatron's mock GPT data; with --tokenizer-type "
              "NullTokenizer --vocab-size N no file at all)"),
    Flag("--vocab-size", "data.vocab_size", DATA, int, kinds=("gpt",),
         help="--tokenizer-type NullTokenizer: ids 0..N-1 and eod N (Megatron)"),
    Flag("--data-cache-path", "data.data_cache_path", DATA,
         help="directory where the GPT sample indices are cached and reused (default: built in memory every run)"),
    Flag("--lr-wsd-decay-style", "lr.wsd_decay_style", OPT, choices=("exponential", "linear", "cosine", "minus_sqrt"),
         default="exponential", help="--lr-decay-style WSD: the shape of the final anneal (Megatron)"),
    Flag("--lr-wsd-decay-iters", "lr.wsd_decay_iters", OPT, int,
         help="--lr-decay-style WSD: iterations of the anneal that ends at --lr-decay-iters"),
    Flag("--lr-wsd-decay-samples", None, OPT, int, help="with --train-samples: WSD's anneal in samples"),
    Flag("--use-checkpoint-args", None, CKPT, const=True,
         help="take the model shape flags not given here (layers, hidden, heads, ffn, sequence, positions, "
              "vocabulary padding) from the --load checkpoint"),
    Flag("--log-params-norm", "training.log_params_norm", LOG, const=True,
         help="print the weights' L2 norm (params norm:) in the training line and the metrics file"),
    Flag("--log-num-zeros-in-grad", "training.log_num_zeros_in_grad", LOG, const=True,
         help="accepted (Megatron), not printed: counting zero gradients would read every gradient once more "
              "per step; the grad norm is printed"),
    Flag("--log-throughput", None, LOG, const=True,
         help="accepted (Megatron): the training line always prints samples/s, tokens/s and TFLOP/s/device"),
    Flag("--timing-log-level", None, LOG, int,
         help="accepted (Megatron): the training line always prints the step time; there are no per-phase timers"),
    Flag("--timing-log-option", None, LOG, choices=("max", "minmax", "all"),
         help="accepted (Megatron): see --timing-log-level"),
    Flag("--log-timers-to-tensorboard", "training.log_timers_to_tensorboard", LOG, const=True,
         help="also write the step time (train/step_time_s) to TensorBoard"),
    Flag("--tensorboard-log-interval", "training.tensorboard_log_interval", LOG, int, 1,
         help="write training scalars to TensorBoard/wandb every this many iterations"),
    Flag("--profile", "training.profile", SYS, const=True,
         help="CUDA: cudaProfilerStart/Stop around iterations [--profile-step-start, --profile-step-end) on "
              "--profile-ranks, for nsys --capture-range=cudaProfilerApi (no effect on CPU)"),
    Flag("--profile-step-start", "training.profile_step_start", SYS, int, 10),
    Flag("--profile-step-end", "training.profile_step_end", SYS, int, 12),
    Flag("--profile-ranks", "training.profile_ranks", SYS, int, nargs="+", help="default: rank 0"),
    Flag("--empty-unused-memory-level", "training.empty_unused_memory_level", SYS, int, 0,
         help="CUDA: 1 or 2 return the caching allocator's free blocks after every iteration "
              "(torch.cuda.empty_cache; slower, less reserved memory); 0 never"),
    Flag("--attention-softmax-in-fp32", None, SYS, const=True,
         help="accepted (Megatron): attention is torch's scaled_dot_product_attention, whose kernels compute "
              "the softmax in fp32"),
    Flag("--no-masked-softmax-fusion", None, SYS, const=True,
         help="accepted (Megatron): there is no masked-softmax kernel to switch off (see --fused-kernels)"),
    Flag("--no-bias-gelu-fusion", None, SYS, const=True,
         help="accepted (Megatron): bias and GeLU are never fused here (see --fused-kernels)"),
    Flag("--no-bias-dropout-fusion", None, SYS, const=True,
         help="accepted (Megatron): bias, dropout and residual are never fused here"),
    Flag("--use-cpu-initialization", "system.use_cpu_initialization", SYS, const=True,
         help="draw every full weight on the CPU from the seed and split it: the same model at every layout "
              "(default: each rank draws only its own shards, on its device, from its own stream)"),
    Flag("--overlap-grad-reduce", None, SYS, const=True,
         help="accepted (Megatron): gradient reductions are always issued asynchronously and overlapped"),
    Flag("--overlap-param-gather", None, SYS, const=True,
         help="accepted (Megatron): the distributed optimizer's all-gather is asynchronous (2BW overlaps it "
              "with the next step)"),
    Flag("--use-flash-attn", None, SYS, const=True,
         help="accepted (Megatron): scaled_dot_product_attention picks flash attention on CUDA where it applies"),
    Flag("--num-workers", None, SYS, int,
         help="accepted (Megatron): batches are read in the training process (memory-mapped), no loader workers"),
    # ---- Megatron-LM flags a newcomer's scripts passed (issue 45), with Megatron's meaning
    Flag("--ckpt-step", "training.ckpt_step", CKPT, int,
         help="load this iteration of --load instead of the one latest_checkpointed_iteration.txt names (Megatron)"),
    Flag("--train-data-path", "data.train_data_path", DATA, nargs="+",
         help="the training split's own PREFIX or blend (W1 PREFIX1 ...), all of its documents; instead of "
              "--data-path and --split (Megatron)"),
    Flag("--valid-data-path", "data.valid_data_path", DATA, nargs="+",
         help="the validation split's own data, as --train-data-path (Megatron)"),
    Flag("--test-data-path", "data.test_data_path", DATA, nargs="+",
         help="the test split's own data, as --train-data-path (Megatron)"),
    Flag("--finetune-ignore-tokenizer", "training.finetune_ignore_tokenizer", CKPT, const=True,
         help="--finetune from a checkpoint trained with another tokenizer (refused without it): a warning names both"),
    Flag("--kv-channels", None, MODEL, int,
         help="channels per attention head (Megatron): accepted when it is --hidden-size / --num-attention-heads, "
              "the only head size the models here build"),
)
# What the tools (planner, profiler, simulator) take beyond the trainer's model flags: the trainer
# gets the kind from its script's name and the vocabulary from its tokenizer.
TOOL_MODEL_FLAGS: tuple[Flag, ...] = (
    Flag("--model-kind", "model.kind", MODEL, choices=KINDS, help="default: the preset's, else gpt"),
    Flag("--vocab-size", "model.vocab_size", MODEL, int, help=f"default: the preset's, else {GPT2_VOCAB}"),
)
