"""AMP006 step-bypasses-scaler: optimizer.step() on scaled grads; scaler.step without update."""
import torch
from accelerate import Accelerator

# ---------------------------------------------------------------- positives


def plain_step_after_scaled_backward(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step()  # AMP006


def scaled_loss_alias(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss = scaler.scale(loss)
    loss.backward()
    optimizer.step()  # AMP006


def scaled_loss_new_name(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaled_loss = scaler.scale(loss)
    scaled_loss.backward()
    optimizer.step()  # AMP006
    optimizer.zero_grad()


def local_scaler_in_loop(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda"):
            loss = model(batch)
        scaler.scale(loss).backward()
        optimizer.step()  # AMP006
        scaler.update()


def unscaled_then_plain_step(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()  # AMP006
    scaler.update()


def step_without_update(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # AMP006
    optimizer.zero_grad()


def step_without_update_in_loop(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        with torch.autocast("cuda"):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # AMP006
        optimizer.zero_grad(set_to_none=True)


def accumulation_plain_step(model, loader, optimizer, scaler, accum_steps):
    for i, batch in enumerate(loader):
        with torch.autocast("cuda"):
            loss = model(batch) / accum_steps
        scaler.scale(loss).backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()  # AMP006
            optimizer.zero_grad()


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.optimizer.step()  # AMP006
        self.optimizer.zero_grad()


def two_optimizers_one_plain(model, batch, opt_body, opt_head, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(opt_body)
    opt_head.step()  # AMP006
    scaler.update()


def scaled_branch_then_shared_step(model, batch, optimizer, scaler, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    optimizer.step()  # AMP006
    optimizer.zero_grad()


def scaler_enabled_by_flag(model, batch, optimizer, use_amp):
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step()  # AMP006


def scaled_division_backward(model, batch, optim, scaler, accum):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss / accum).backward()
    optim.step()  # AMP006


def step_in_branch_without_update(model, batch, optimizer, scaler, step, accum):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    if (step + 1) % accum == 0:
        scaler.step(optimizer)  # AMP006
        optimizer.zero_grad()


def generator_discriminator(gen, disc, batch, opt_g, opt_d, scaler):
    with torch.autocast("cuda"):
        d_loss = disc(batch)
    scaler.scale(d_loss).backward()
    opt_d.step()  # AMP006
    with torch.autocast("cuda"):
        g_loss = gen(batch)
    scaler.scale(g_loss).backward()
    scaler.step(opt_g)
    scaler.update()


def multiline_plain_step(model, batch, optimizer, scaler, closure):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step(  # AMP006
        closure,
    )


# ---------------------------------------------------------------- negatives


class ScaledBackwardPlainStepInAnotherMethod:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.optimizer.step()  # AMP006
        self.scaler.update()
        self.optimizer.zero_grad()


def scaler_step_and_update(model, batch, optimizer, scheduler, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad()


def scheduler_after_accumulation(model, loader, optimizer, lr_scheduler, scaler, accum):
    for i, batch in enumerate(loader):
        with torch.autocast("cuda"):
            loss = model(batch) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        lr_scheduler.step()


def no_scaler_branch(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def correlated_use_amp_branches(model, batch, optimizer, scaler, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if use_amp:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def mixed_conditions(model, batch, optimizer, scaler, args):
    with torch.autocast("cuda", enabled=args.amp):
        loss = model(batch)
    if args.amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def disabled_scaler(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step()


def accelerate_prepared_optimizer(model, loader, optimizer):
    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.autocast():
            loss = model(batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def mmengine_update_params(model, batch, optim_wrapper):
    with optim_wrapper.optim_context(model):
        loss = model(batch)
    optim_wrapper.update_params(loss)


def lightning_manual_backward(self, batch):
    opt = self.optimizers()
    loss = self.model(batch)
    self.manual_backward(loss)
    opt.step()
    opt.zero_grad()


def timm_native_scaler(model, batch, optimizer, loss_scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
    optimizer.zero_grad()


def helper_with_scaler(model, batch, optimizer, scaler, backward_and_step):
    with torch.autocast("cuda"):
        loss = model(batch)
    backward_and_step(loss, optimizer, scaler)


def bf16_plain_step(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def early_return_amp_path(model, batch, optimizer, scaler):
    with torch.autocast("cuda", enabled=scaler is not None):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss
    loss.backward()
    optimizer.step()
    return loss




class SplitStep:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward_and_step(self, loss):
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)

    def end_of_iteration(self):
        self.scaler.update()
        self.optimizer.zero_grad()


def two_optimizers_one_update(model, batch, opt_a, opt_b, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()


def ema_and_scheduler_steps(model, ema, batch, optimizer, scheduler, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    ema.step(model)
    scheduler.step()


def apex_scale_loss(model, batch, optimizer, amp):
    loss = model(batch)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


def optimizer_wrapping_the_scaler(model, batch, base_optimizer, scaler, AmpOptimizer):
    optimizer = AmpOptimizer(base_optimizer, scaler=scaler)
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    optimizer.step()


class LocalAliasUpdatedInAnotherMethod:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.grad_scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        scaler = self.grad_scaler
        with torch.autocast("cuda"):
            loss = self.model(batch)
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)

    def on_step_end(self):
        self.grad_scaler.update()


class UnscaleInOwnMethod:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def _step_optimizer(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self._step_optimizer()
        self.optimizer.zero_grad()


def step_helper_updated_by_caller(optimizer, scaler):
    scaler.unscale_(optimizer)
    scaler.step(optimizer)


def step_helper_called_from_another_module(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def caller_updates(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    step_helper_updated_by_caller(optimizer, scaler)
    scaler.update()


def optimizer_known_by_its_class(model, batch, scaler):
    adam = torch.optim.Adam(model.parameters())
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    adam.step()  # AMP006


class StepperFromAnotherModule(Accelerator):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.optimizer.step()


class ScalerHandedToAStepHelper:
    def __init__(self, model, optimizer, step_fn):
        self.model = model
        self.optimizer = optimizer
        self.step_fn = step_fn
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def sync(self):
        self.step_fn(self.scaler, self.optimizer)

    def step(self):
        self.optimizer.step()


class OwnBackwardBeforeThePlainStep:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def amp_backward(self, loss):
        self.scaler.scale(loss).backward()

    def fp32_step(self, batch):
        self.model(batch).backward()
        self.optimizer.step()


# ---- scaled backward through torch.autograd.backward; a second step after the scaler -----


def autograd_backward_then_plain_step(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    torch.autograd.backward(scaler.scale(loss))
    optimizer.step()  # AMP006


def second_plain_step_after_update(model, batch, optimizer, scaler, lookahead):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if lookahead:
        optimizer.step()  # AMP006


def autograd_backward_through_the_scaler(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    torch.autograd.backward(scaler.scale(loss))
    scaler.step(optimizer)
    scaler.update()


def plain_step_after_a_new_plain_backward(model, batches, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batches[0])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    model(batches[1]).float().backward()
    optimizer.step()


class ScaledBackwardBase:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()


class PlainStepInTheSubclass(ScaledBackwardBase):
    def optimizer_step(self):
        self.optimizer.step()  # AMP006
        self.optimizer.zero_grad()


class UpdatesInTheBaseLoop:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def fit(self, loader):
        for batch in loader:
            self.train_step(batch)
            self.scaler.update()

    def train_step(self, batch):
        raise NotImplementedError


class StepsInTheSubclass(UpdatesInTheBaseLoop):
    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)


def plain_step_after_the_scaler_branch(model, loader, criterion, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", enabled=scaler is not None):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
        optimizer.step()  # AMP006


def plain_step_after_the_amp_flag_branch(model, loader, optimizer, scaler, use_amp):
    for batch in loader:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", enabled=use_amp):
            loss = model(batch)
        if use_amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
        if optimizer is not None:
            optimizer.step()  # AMP006


def plain_step_only_in_the_else_branch(model, loader, criterion, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", enabled=scaler is not None):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()


def scaler_step_or_plain_step(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    if scaler:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def second_optimizer_after_the_scaler_branch(model, head, batch, optimizer, head_opt, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    head_opt.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    head_opt.zero_grad()
    head(batch).float().mean().backward()
    head_opt.step()


def plain_step_in_the_next_iteration(model, loader, optimizer, scaler):
    for i, batch in enumerate(loader):
        with torch.autocast("cuda"):
            loss = model(batch)
        if i % 2 == 0:
            loss.float().backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()


def plain_step_after_zero_grad_and_a_plain_backward(model, aux, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    aux(batch).float().backward()
    optimizer.step()


def second_optimizer_zeroed_after_the_scaled_backward(actor, data, actor_opt, alpha_opt, log_alpha, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        actor_loss = actor(data).mean()
    actor_opt.zero_grad()
    scaler.scale(actor_loss).backward()
    actor_opt.step()  # AMP006
    alpha_loss = (-log_alpha.exp() * actor_loss.detach()).mean()
    alpha_opt.zero_grad()
    alpha_loss.backward()
    alpha_opt.step()


def second_optimizer_not_zeroed_after_the_scaled_backward(actor, data, actor_opt, alpha_opt, log_alpha, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        actor_loss = actor(data).mean()
    alpha_opt.zero_grad()
    scaler.scale(actor_loss).backward()
    actor_opt.step()  # AMP006
    alpha_loss = (-log_alpha.exp() * actor_loss.detach()).mean()
    alpha_loss.backward()
    alpha_opt.step()  # AMP006


def critic_model_zeroed_after_the_scaled_backward(actor, critic, data, actor_opt, scaler):
    critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    with torch.autocast("cuda", dtype=torch.float16):
        actor_loss = -critic(actor(data)).mean()
    actor_opt.zero_grad()
    scaler.scale(actor_loss).backward()
    scaler.step(actor_opt)
    scaler.update()
    critic.zero_grad(set_to_none=True)
    critic(data).float().pow(2).mean().backward()
    critic_opt.step()


def one_of_two_models_zeroed_after_the_scaled_backward(qf1, qf2, data, scaler):
    q_opt = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = qf1(data).mean() + qf2(data).mean()
    scaler.scale(loss).backward()
    qf1.zero_grad()
    qf1(data).float().mean().backward()
    q_opt.step()  # AMP006


def second_optimizer_stepped_after_the_scaler_updates(model, log_vars, data, optimizer, scaler):
    """Uncertainty weights in the scaled loss, stepped by their own optimizer past the scaler."""
    weight_optimizer = torch.optim.SGD([log_vars], lr=0.1)
    with torch.autocast("cuda", dtype=torch.float16):
        parts = model(data)
        loss = sum(torch.exp(-lv) * part + lv for lv, part in zip(log_vars, parts))
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    weight_optimizer.step()  # AMP006
    optimizer.zero_grad()
    weight_optimizer.zero_grad()


def both_optimizers_through_the_scaler_before_one_update(model, log_vars, data, optimizer, scaler):
    weight_optimizer = torch.optim.SGD([log_vars], lr=0.1)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = (model(data) * log_vars.exp()).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.step(weight_optimizer)
    scaler.update()


def second_optimizer_after_its_own_plain_backward(model, critic, data, optimizer, critic_opt, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(data).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    critic_opt.zero_grad()
    critic(data).float().pow(2).mean().backward()
    critic_opt.step()


class TaskWeightedTrainer:
    """Backward in one method, both steps in another: the weights' optimizer holds the same
    scaled gradients the scaler just stepped past."""

    def __init__(self, model, log_vars):
        self.optimizer = torch.optim.AdamW(model.parameters())
        self.weight_optimizer = torch.optim.Adam([log_vars], lr=1e-3)
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def train_step(self, loss):
        self.backward(loss)
        self.optimizer_step()

    def optimizer_step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.weight_optimizer.step()  # AMP006
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_optimizer.zero_grad(set_to_none=True)


class GanTrainerWithPlainDiscriminatorBackward:
    """The discriminator's gradients come from a plain fp32 backward of its own."""

    def __init__(self, generator, discriminator):
        self.opt_g = torch.optim.Adam(generator.parameters())
        self.opt_d = torch.optim.Adam(discriminator.parameters())
        self.scaler = torch.amp.GradScaler("cuda")

    def backward_generator(self, loss):
        self.scaler.scale(loss).backward()

    def backward_discriminator(self, loss):
        loss.float().backward()

    def step(self):
        self.scaler.step(self.opt_g)
        self.scaler.update()
        self.opt_d.step()


class BaseStepTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_gradients(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


class LearnedWeightsTrainer(BaseStepTrainer):
    """Overrides the base class's step: the weights' optimizer steps the same scaled backward."""

    def __init__(self, model, optimizer, log_vars):
        super().__init__(model, optimizer)
        self.weight_optimizer = torch.optim.Adam([log_vars], lr=1e-2)

    def optimizer_step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.weight_optimizer.step()  # AMP006
        self.weight_optimizer.zero_grad(set_to_none=True)
