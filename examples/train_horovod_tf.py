"""Train a small Keras model with Horovod + TensorFlow and let qsync's Recorder record and report on it.

    python examples/train_horovod_tf.py                                            # 1 process
    horovodrun -np 2 -H localhost:2 --gloo python examples/train_horovod_tf.py     # 2 processes
    python examples/train_horovod_tf.py --mode apply      # then plan, apply, verify: keep or roll back
    python examples/train_horovod_tf.py --mode apply      # again: applies the kept plan at the first step
    python examples/train_horovod_tf.py --plan other/plan.json   # a given plan, then record and report
    horovodrun -np 2 -H localhost:2 --gloo python examples/train_horovod_tf.py --mode apply --horovod-timeline
                                                   # also price gradient groups and fusion settings

Threads (``--threads``, ``--inter-threads``, ``--cycle-time-ms``, ``--pin``; compared by
``benchmarks/horovod_tf_accuracy.py --settings ...``): by default each process gets TF intra- and
inter-op pools of cores / processes on this host (1 and 1 for two processes on 2 cores; TF's own
pools, as many threads as cores each, oversubscribe the cores); Horovod's cycle time stays
Horovod's 1 ms; and each process, all its threads (TF's, Horovod's and Gloo's), is bound to its share
of the cores (``--pin all``; ``--pin none`` leaves them to the kernel): on two processes sharing
two cores it narrows the step-to-step spread at no slower a step (the thread settings compared in
`benchmarks/README.md`).

The data is generated (Gaussian clusters, fixed seed): nothing is downloaded. After the recorded
window rank 0 prints measured against predicted step time and writes ``<output_dir>/report.json``;
every rank writes its trace under ``<output_dir>/trace/rank<k>/``. With ``--mode apply`` rank 0 also
prints the plans it priced and writes ``plan.json`` (and ``verification.json`` when a plan was
applied) there, and every rank prints the plan in force at the end. The kept plan goes into the plan
cache too: a later ``--mode apply`` of the same job applies it at the first step instead of planning
again (``--plan none``: plan again).
"""

from __future__ import annotations

import argparse
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from qsync_callback.alternation import LOOKS, ROUNDS  # noqa: E402
from qsync_callback.integrations.horovod_tf import Recorder, profile, record_horovod_timeline  # noqa: E402
from qsync_callback.plan import Plan  # noqa: E402

MODELS = ("mlp", "cnn", "gru", "resnet")
VOCABULARY, TOKENS = 2000, 64  # the gru model's sequences
PIN_MODES = ("none", "compute", "all")
CLASSES = 10


def build_model(kind: str) -> tf.keras.Model:
    """An MLP over 256 features; a small CNN, or a residual CNN with batch norm, over 32x32 RGB
    images; or an embedding + bidirectional GRU text classifier over sequences of 64 tokens."""
    layers = tf.keras.layers
    if kind == "gru":
        tokens = tf.keras.Input((TOKENS,), dtype="int32")
        x = layers.Embedding(VOCABULARY, 64, name="embed")(tokens)
        x = layers.Bidirectional(layers.GRU(64), name="bigru")(x)
        return tf.keras.Model(tokens, layers.Dense(CLASSES, name="head")(x), name="gru")
    if kind == "resnet":
        images = tf.keras.Input((32, 32, 3))
        x = layers.Conv2D(32, 3, padding="same", name="stem")(images)
        for block in range(3):
            y = layers.Conv2D(32, 3, padding="same", use_bias=False, name=f"block{block}_conv1")(x)
            y = layers.ReLU()(layers.BatchNormalization(name=f"block{block}_bn1")(y))
            y = layers.Conv2D(32, 3, padding="same", use_bias=False, name=f"block{block}_conv2")(y)
            y = layers.BatchNormalization(name=f"block{block}_bn2")(y)
            x = layers.ReLU()(layers.Add()([x, y]))
        x = layers.GlobalAveragePooling2D(name="pool")(x)
        return tf.keras.Model(images, layers.Dense(CLASSES, name="head")(x), name="resnet")
    if kind == "mlp":
        model = tf.keras.Sequential(
            [
                layers.Dense(1024, activation="relu", name="fc1"),
                layers.Dense(1024, activation="relu", name="fc2"),
                layers.Dense(CLASSES, name="head"),
            ],
            name="mlp",
        )
        model.build((None, 256))
    else:
        model = tf.keras.Sequential(
            [
                layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1"),
                layers.MaxPooling2D(name="pool1"),
                layers.Conv2D(64, 3, padding="same", activation="relu", name="conv2"),
                layers.MaxPooling2D(name="pool2"),
                layers.Flatten(name="flatten"),
                layers.Dense(128, activation="relu", name="fc"),
                layers.Dense(CLASSES, name="head"),
            ],
            name="cnn",
        )
        model.build((None, 32, 32, 3))
    return model


def cluster_batches(kind: str, batch_size: int, count: int = 8, seed: int = 0) -> list[tuple]:
    """``count`` batches of Gaussian clusters, one cluster per class, shaped for the model (for the
    gru model: token sequences, each class drawing its tokens from its own part of the vocabulary)."""
    rng = np.random.default_rng(seed)
    if kind == "gru":
        batches = []
        for _ in range(count):
            labels = rng.integers(0, CLASSES, batch_size)
            tokens = labels[:, None] * (VOCABULARY // CLASSES) + rng.integers(
                0, VOCABULARY // CLASSES, (batch_size, TOKENS)
            )
            batches.append((tf.constant(tokens, tf.int32), tf.constant(labels, tf.int32)))
        return batches
    shape = (256,) if kind == "mlp" else (32, 32, 3)  # cnn, resnet
    centers = rng.normal(size=(CLASSES, *shape)).astype(np.float32)
    batches = []
    for _ in range(count):
        labels = rng.integers(0, CLASSES, batch_size)
        points = centers[labels] + rng.normal(size=(batch_size, *shape)).astype(np.float32)
        batches.append((tf.constant(points), tf.constant(labels, tf.int32)))
    return batches


def set_threads(threads: int | None, inter_threads: int | None, pin: str = "none") -> str:
    """TF's thread pools for this process (after ``hvd.init()``, before TF runs anything): intra-op
    ``threads`` (None: cores / processes on this host; 0: TF's own), inter-op ``inter_threads``
    (None: as intra-op). ``pin`` (with more than one process on this host): "compute" binds this
    thread and so the TF threads it starts later to the process's share of the cores (by local
    rank), "all" also the threads that run already (Horovod's background loop, Gloo's). Returns
    what it set, in words."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // hvd.local_size())
    intra = share if threads is None else threads
    inter = intra if inter_threads is None else inter_threads
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    said = f"TF threads {intra or 'TF default'} intra-op, {inter or 'TF default'} inter-op"
    if pin == "none" or hvd.local_size() == 1 or len(cores) < hvd.local_size():
        return said + ", not pinned"
    mine = cores[hvd.local_rank() * share : (hvd.local_rank() + 1) * share]
    os.sched_setaffinity(threading.get_native_id(), mine)  # this thread only; its new threads inherit
    if pin == "all":
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), mine)
            except OSError:
                pass  # a thread that ended meanwhile
    return said + f", {'all threads' if pin == 'all' else 'TF threads'} pinned to cores {mine}"


def describe(plan: Plan | None) -> str:
    """What a plan changes, in a few words."""
    if plan is None or plan.is_empty:
        return "none (the step as written)"
    low = sorted(t for t, p in plan.op_precision.items() if p == "bf16")
    parts = [
        f"bf16 op types {','.join(low)}" if low else "",
        "bf16 on every layer" if plan.precision else "",
        "XLA" if plan.fused_regions else "",
        f"{len(plan.buckets)} gradient groups" if plan.buckets else "",
        "fusion settings" if plan.communication else "",
    ]
    return "; ".join(p for p in parts if p)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, help="training steps (default: until the recorder is done)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--output-dir", default="runs/horovod_tf/qsync")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--verify-steps", type=int, default=3, help="mode apply: calls recorded under it")
    parser.add_argument("--mode", choices=("record", "report", "apply"), default="report")
    parser.add_argument(
        "--threads",
        type=int,
        help="TF's intra-op (and inter-op) threads per process (default: cores / processes on this host;"
        " 0: TF's own, as many as cores)",
    )
    parser.add_argument(
        "--inter-threads", type=int, help="TF's inter-op threads per process (default: --threads)"
    )
    parser.add_argument(
        "--cycle-time-ms",
        type=float,
        help="Horovod's cycle time (sets HOROVOD_CYCLE_TIME unless it is set; default: Horovod's, 1 ms)",
    )
    parser.add_argument(
        "--pin",
        choices=PIN_MODES,
        default="all",
        help="bind each process's TF threads ('compute'), or all its threads, Horovod's and Gloo's too"
        " ('all'), to its share of this host's cores, or none of them ('none') (default: all)",
    )
    parser.add_argument(
        "--alternate-rounds",
        type=int,
        default=ROUNDS,
        help="mode apply: rounds of the recorded configuration and the plan in turns after verify (0: none)",
    )
    parser.add_argument(
        "--alternate-looks",
        type=int,
        default=LOOKS,
        help="mode apply: while the turns cannot tell the plan from the baseline, as many more rounds,"
        f" up to this many times as many (default: {LOOKS})",
    )
    parser.add_argument(
        "--plan",
        help="a plan.json to apply at the first step (default in mode apply: the one kept in the plan cache"
        " for this job; 'none': no plan, none kept)",
    )
    parser.add_argument(
        "--horovod-timeline",
        action="store_true",
        help="record Horovod's timeline in the recorded steps (prices fusion plans; costs a core on rank 0)",
    )
    args = parser.parse_args()

    if args.horovod_timeline:
        record_horovod_timeline()
    if args.cycle_time_ms is not None:
        os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{args.cycle_time_ms:g}")
    hvd.init()
    print(f"rank {hvd.rank()}: {set_threads(args.threads, args.inter_threads, args.pin)}", flush=True)
    tf.random.set_seed(0)
    model = build_model(args.model)
    optimizer = tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = cluster_batches(args.model, args.batch_size, seed=hvd.rank())
    recorder = Recorder(
        model=model,
        batch_size=args.batch_size,
        output_dir=args.output_dir,
        warmup_steps=args.warmup_steps,
        profile_steps=args.profile_steps,
        measure_steps=args.measure_steps,
        mode=args.mode,
        optimizer=optimizer,
        verify_steps=args.verify_steps,
        alternate_rounds=args.alternate_rounds,
        alternate_looks=args.alternate_looks,
        plan=False if args.plan == "none" else args.plan,
    )

    @profile(recorder)
    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, groups=recorder.groups)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:
            # start every rank from rank 0's weights (after the first step, once the optimizer's
            # variables exist)
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    step = 0
    while (step < args.steps) if args.steps is not None else not recorder.finished:
        x, y = batches[step % len(batches)]
        loss = train_step(x, y, step == 0)
        step += 1
    if args.mode == "apply" or args.plan not in (None, "none"):
        print(f"rank {hvd.rank()}: qsync plan in force: {describe(recorder.plan)}", flush=True)
    if hvd.rank() == 0:
        print(f"step {step}: loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
