"""A motor drive as a pure function of ``(seed, anomalies, t)``. No I/O, no wall clock.

The plant is a 4-pole induction motor on a VFD (400 V mains, ~11 kW, ~20 A rated) driving a
partly fan-like load through a duty cycle; its six signals and their models are listed on
:class:`MotorPlant`. Values are sample-and-hold on a 100 Hz step grid and bit-identical
whatever the order of queries; anomalies change the *measured* value of one signal, never the
physics.

Design: ``docs/ARCHITECTURE.md``, "The plant simulator".
"""

import bisect
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, cast

from drivers.errors import DriverConfigError

AnomalyKind = Literal["drift", "spike", "stuck", "dropout", "noise"]
ANOMALY_KINDS: tuple[AnomalyKind, ...] = ("drift", "spike", "stuck", "dropout", "noise")

#: The measured signals, in the order :meth:`MotorPlant.values_at` returns them.
SIGNALS: tuple[str, ...] = ("voltage", "current", "frequency", "speed", "temperature", "vibration")
UNITS: Mapping[str, str] = {
    "voltage": "V",
    "current": "A",
    "frequency": "Hz",
    "speed": "rpm",
    "temperature": "degC",
    "vibration": "mm/s",
}
#: Standard deviation of each signal's measurement noise (signal units).
NOISE_STD: Mapping[str, float] = {
    "voltage": 0.6,
    "current": 0.08,
    "frequency": 0.02,
    "speed": 1.5,
    "temperature": 0.05,
    "vibration": 0.05,
}

STEP_HZ = 100
STEP_S = 1.0 / STEP_HZ

# Physics. Rated point: 50 Hz, 1460 rpm, ~19 A at full load.
_BASE_HZ = 50.0
_RPM_PER_HZ = 30.0  # 4 poles: 120 / 4
_RAMP_HZ_PER_S = 5.0  # 0 -> 50 Hz in 10 s, always shorter than the shortest segment (20 s)
_RATED_SLIP_RPM = 40.0
_I_MAG_A = 6.5
_I_TORQUE_RATED_A = 18.0
_ACCEL_TORQUE_PU = 0.3
_LOAD_SETTLE_S = 2.0
_V_NOMINAL = 400.0
_THERMAL_TAU_S = 300.0
_R_THERMAL = 0.2  # degC per A^2: ~+75 K at rated current, a class-F winding's rise
_THERMAL_DECAY = math.exp(-STEP_S / _THERMAL_TAU_S)
_RESONANCE_RPM = 1040.0
OVERTEMP_WARNING_C = 85.0

# Duty cycle.
_FIRST_SEGMENT_STEPS = 5 * STEP_HZ
_SEGMENT_MIN_STEPS = 20 * STEP_HZ
_SEGMENT_SPAN_STEPS = 40 * STEP_HZ
_SETPOINTS_HZ = (20.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0)
_STOP_PROBABILITY = 0.12

# Spikes: one per second of the interval, 100 ms long.
_SPIKE_SLOT_STEPS = STEP_HZ
_SPIKE_STEPS = 10

_CHECKPOINT_STEPS = STEP_HZ  # one temperature checkpoint per plant second
_CHUNK_CACHE = 4

# RNG stream ids: every random quantity has its own stream so adding one never shifts another.
_S_SEGMENT = 1
_S_SETPOINT = 2
_S_LOAD = 3
_S_STOP = 4
_S_PLANT = 5
_S_NOISE = 16  # + signal index, two uniforms each
_S_SPIKE = 64  # + signal index

_MASK = (1 << 64) - 1
_NONNEGATIVE = frozenset({"current", "frequency", "speed", "vibration"})


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform(key: int, stream: int, counter: int) -> float:
    """A uniform in (0, 1), a pure function of its arguments (counter-based RNG)."""
    h = _mix64(_mix64(key ^ (stream * 0xD1B54A32D192ED03 & _MASK)) ^ (counter & _MASK))
    return ((h >> 11) + 0.5) / 9007199254740992.0  # 2**53; never 0, so log() is safe


def _gauss(key: int, stream: int, counter: int) -> float:
    """A standard normal by Box-Muller from two counter-keyed uniforms."""
    u1 = _uniform(key, stream, 2 * counter)
    u2 = _uniform(key, stream, 2 * counter + 1)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def step_index(t_s: float) -> int:
    """The 100 Hz step that holds time ``t_s`` (the tiny epsilon absorbs ``0.3 * 100``)."""
    if not math.isfinite(t_s) or t_s < 0:
        raise ValueError(f"plant time must be a finite number >= 0, got {t_s!r}")
    return math.floor(t_s * STEP_HZ + 1e-6)


def _boundary_step(t_s: float) -> int:
    """First step at or after ``t_s``: anomaly interval ends snap to the grid this way."""
    return math.ceil(t_s * STEP_HZ - 1e-6)


def _format_number(x: float) -> str:
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A fault on one measured signal during ``[start_s, start_s + duration_s)`` plant time.

    See the module docstring for what each kind does and what ``magnitude`` means for it.
    ``str(anomaly)`` gives the CLI form that :func:`parse_anomaly` reads back. Raises
    :class:`DriverConfigError` when a field is out of range.
    """

    kind: AnomalyKind
    signal: str
    start_s: float
    duration_s: float
    magnitude: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ANOMALY_KINDS:
            raise DriverConfigError(
                f"anomaly kind {self.kind!r} unknown; expected one of {', '.join(ANOMALY_KINDS)}"
            )
        if self.signal not in SIGNALS:
            raise DriverConfigError(
                f"anomaly signal {self.signal!r} unknown; expected one of {', '.join(SIGNALS)}"
            )
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise DriverConfigError(f"anomaly start {self.start_s!r} s must be >= 0")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise DriverConfigError(f"anomaly duration {self.duration_s!r} s must be > 0")
        if not math.isfinite(self.start_s + self.duration_s):
            raise DriverConfigError(
                f"anomaly end {self.start_s!r} + {self.duration_s!r} s is beyond any plant time"
            )
        if not math.isfinite(self.magnitude):
            raise DriverConfigError(f"anomaly magnitude {self.magnitude!r} must be finite")
        if self.kind == "noise" and self.magnitude < 0:
            raise DriverConfigError(
                f"noise magnitude {self.magnitude!r} is a std multiplier and must be >= 0"
            )

    @property
    def end_s(self) -> float:
        """First plant time after the interval."""
        return self.start_s + self.duration_s

    @property
    def start_step(self) -> int:
        """First 100 Hz step inside the interval."""
        return _boundary_step(self.start_s)

    @property
    def end_step(self) -> int:
        """First 100 Hz step after the interval."""
        return _boundary_step(self.end_s)

    def active_at(self, t_s: float) -> bool:
        """Whether the anomaly affects the value :meth:`MotorPlant.values_at` gives for ``t_s``."""
        return self._active_step(step_index(t_s))

    def _active_step(self, k: int) -> bool:
        return self.start_step <= k < self.end_step

    def __str__(self) -> str:
        text = (
            f"{self.kind}:{self.signal}@{_format_number(self.start_s)}"
            f"+{_format_number(self.duration_s)}"
        )
        if self.kind in _MAGNITUDE_KINDS:
            text += f"x{_format_number(self.magnitude)}"
        return text


_MAGNITUDE_KINDS = frozenset({"drift", "spike", "noise"})
_ANOMALY_RE = re.compile(
    r"(?P<kind>[^:]*):(?P<signal>[^@]*)@(?P<start>[^+]*)\+(?P<duration>[^x]*)(?:x(?P<magnitude>.*))?"
)
_UNSIGNED_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_SIGNED_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
ANOMALY_GRAMMAR = "KIND:SIGNAL@START+DURATION[xMAGNITUDE]"


def parse_anomaly(text: str) -> Anomaly:
    """Read the CLI form of an anomaly, e.g. ``drift:temperature@30+20x5``.

    Grammar (no spaces inside; surrounding whitespace is ignored)::

        anomaly   = kind ":" signal "@" start "+" duration [ "x" magnitude ]
        kind      = "drift" | "spike" | "stuck" | "dropout" | "noise"
        signal    = "voltage" | "current" | "frequency" | "speed" | "temperature" | "vibration"
        start     = decimal                  ; plant seconds, >= 0
        duration  = decimal                  ; seconds, > 0
        magnitude = [ "+" | "-" ] decimal    ; required for drift, spike, noise;
                                             ; not allowed for stuck, dropout
        decimal   = digits [ "." [ digits ] ] | "." digits

    So ``drift:temperature@30+20x5`` adds 0 -> 5 degC between t = 30 s and t = 50 s.
    Raises :class:`DriverConfigError` naming the input and what is wrong with it.
    """
    source = text.strip()
    prefix = f"bad anomaly {text!r}"
    match = _ANOMALY_RE.fullmatch(source)
    if match is None:
        raise DriverConfigError(
            f"{prefix}: expected {ANOMALY_GRAMMAR}, e.g. 'drift:temperature@30+20x5'"
        )
    kind, signal = match["kind"], match["signal"]
    if kind not in ANOMALY_KINDS:
        raise DriverConfigError(
            f"{prefix}: unknown kind {kind!r}; expected one of {', '.join(ANOMALY_KINDS)}"
        )
    if signal not in SIGNALS:
        raise DriverConfigError(
            f"{prefix}: unknown signal {signal!r}; expected one of {', '.join(SIGNALS)}"
        )
    numbers: dict[str, float] = {}
    for field, pattern in (("start", _UNSIGNED_RE), ("duration", _UNSIGNED_RE)):
        raw = match[field]
        if not pattern.fullmatch(raw):
            raise DriverConfigError(f"{prefix}: {field} {raw!r} is not a decimal number of seconds")
        numbers[field] = float(raw)
    raw_magnitude = match["magnitude"]
    magnitude = 0.0
    if kind in _MAGNITUDE_KINDS:
        if raw_magnitude is None:
            raise DriverConfigError(f"{prefix}: {kind} needs a magnitude (append xMAGNITUDE)")
        if not _SIGNED_RE.fullmatch(raw_magnitude):
            raise DriverConfigError(f"{prefix}: magnitude {raw_magnitude!r} is not a number")
        magnitude = float(raw_magnitude)
    elif raw_magnitude is not None:
        raise DriverConfigError(f"{prefix}: {kind} takes no magnitude (drop 'x{raw_magnitude}')")
    try:
        return Anomaly(
            kind=cast(AnomalyKind, kind),
            signal=signal,
            start_s=numbers["start"],
            duration_s=numbers["duration"],
            magnitude=magnitude,
        )
    except DriverConfigError as exc:
        raise DriverConfigError(f"{prefix}: {exc}") from None


class DriveState(NamedTuple):
    """The drive's own view of itself at one step: noise-free and never hit by anomalies.

    ``ramp_state`` is 0 steady, 1 accelerating, 2 decelerating. ``overtemp_warning`` compares
    the drive's thermal model (the noise-free temperature) with :data:`OVERTEMP_WARNING_C`.
    ``uptime`` is whole plant seconds since t = 0.
    """

    running: bool
    ramp_state: int
    at_setpoint: bool
    overtemp_warning: bool
    frequency_setpoint: float
    ambient_temperature: float
    uptime: int

    def as_signals(self) -> dict[str, float]:
        """The state as named values, the names the register map and the DBC use."""
        return {
            "running": float(self.running),
            "ramp_state": float(self.ramp_state),
            "at_setpoint": float(self.at_setpoint),
            "overtemp_warning": float(self.overtemp_warning),
            "frequency_setpoint": self.frequency_setpoint,
            "ambient_temperature": self.ambient_temperature,
            "uptime": float(self.uptime),
        }


#: Names :meth:`DriveState.as_signals` produces.
STATE_SIGNALS: tuple[str, ...] = (
    "running",
    "ramp_state",
    "at_setpoint",
    "overtemp_warning",
    "frequency_setpoint",
    "ambient_temperature",
    "uptime",
)


class _Step(NamedTuple):
    """Noise-free quantities of one step, temperature excepted."""

    frequency: float
    setpoint: float
    ramp: int  # +1 accelerating, -1 decelerating, 0 steady
    torque: float  # per unit; negative while braking
    current: float
    speed: float
    voltage: float
    vibration: float


class MotorPlant:
    """The motor drive of the module docstring, seeded and with injected anomalies.

    Queries are cheap (tens of microseconds) and deterministic: the same ``(seed,
    anomalies, t)`` gives a bit-identical answer on any instance, in any query order. Not
    thread-safe (it caches); give each thread its own plant.

    The plant is a 4-pole induction motor on a VFD (400 V mains, ~11 kW, ~20 A rated) driving a
    partly fan-like load through a duty cycle: stopped for the first 5 s, then a new frequency
    setpoint every 20-60 s (sometimes 0 = stop), reached on a 5 Hz/s ramp.

    ==============  =====  ====================================================================
    signal          unit   model
    ==============  =====  ====================================================================
    ``voltage``     V      mains ~400 V, slow sinusoidal wander, small dip under current
    ``current``     A      ``sqrt(I_mag² + I_torque²)``; torque = load + acceleration
    ``frequency``   Hz     VFD output: linear ramps between setpoints
    ``speed``       rpm    ``30·f`` (synchronous, 4 poles) minus slip proportional to torque
    ``temperature`` °C     winding: first-order lag (τ = 300 s) towards ``ambient + R·I²``
    ``vibration``   mm/s   RMS: base + ``∝ speed²`` + a structural resonance near 1040 rpm
    ==============  =====  ====================================================================

    Values are sample-and-hold on a 100 Hz step grid and bit-identical whatever the order of
    queries; anomalies (``noise``, ``drift``, ``spike``, ``stuck``, ``dropout``) change the
    *measured* value of one signal, never the physics. How determinism is kept and what each
    anomaly does: docs/ARCHITECTURE.md, "The plant simulator".
    """

    def __init__(self, seed: int, anomalies: Sequence[Anomaly] = ()) -> None:
        self.seed = seed
        self.anomalies: tuple[Anomaly, ...] = tuple(anomalies)
        self._key = _mix64(seed & _MASK)
        self.ambient_c = 18.0 + 12.0 * _uniform(self._key, _S_PLANT, 0)
        self._voltage_phase = 2.0 * math.pi * _uniform(self._key, _S_PLANT, 1)
        self._load_phase = 2.0 * math.pi * _uniform(self._key, _S_PLANT, 2)
        self._by_signal: dict[str, tuple[Anomaly, ...]] = {
            s: tuple(a for a in self.anomalies if a.signal == s) for s in SIGNALS
        }
        # Duty cycle segments, extended lazily; segment 0 is the initial stop.
        self._seg_start: list[int] = [0, _FIRST_SEGMENT_STEPS]
        self._seg_setpoint: list[float] = [0.0]
        self._seg_load: list[float] = [self._draw_load(0)]
        self._draw_segment_body(1)
        # Temperature at every whole plant second, computed in order from t = 0.
        self._checkpoints: list[float] = [self.ambient_c]
        self._chunks: OrderedDict[int, list[float]] = OrderedDict()
        self._last_step: tuple[int, _Step] | None = None
        self._stuck_cache: dict[tuple[str, int], float] = {}

    # -- public API -----------------------------------------------------------------------

    def values_at(self, t_s: float) -> dict[str, float]:
        """Measured signals at plant time ``t_s`` (>= 0), anomalies applied.

        Keys follow :data:`SIGNALS`; a signal in a ``dropout`` is absent.
        """
        k = step_index(t_s)
        step = self._step(k)
        out: dict[str, float] = {}
        for index, signal in enumerate(SIGNALS):
            anomalies = self._by_signal[signal]
            active = [a for a in anomalies if a._active_step(k)] if anomalies else []
            if any(a.kind == "dropout" for a in active):
                continue
            stuck = [a for a in active if a.kind == "stuck"]
            if stuck:
                first = min(stuck, key=lambda a: a.start_step)
                out[signal] = self._stuck_value(index, signal, first.start_step)
            else:
                out[signal] = self._measured(index, signal, k, self._clean(signal, k, step))
        return out

    def state_at(self, t_s: float) -> DriveState:
        """The drive's status at plant time ``t_s`` (not affected by anomalies)."""
        k = step_index(t_s)
        step = self._step(k)
        return DriveState(
            running=step.frequency > 0.0,
            ramp_state={0: 0, 1: 1, -1: 2}[step.ramp],
            at_setpoint=step.ramp == 0 and step.setpoint > 0.0,
            overtemp_warning=self._temperature(k) > OVERTEMP_WARNING_C,
            frequency_setpoint=step.setpoint,
            ambient_temperature=self.ambient_c,
            uptime=k // STEP_HZ,
        )

    def clean_at(self, t_s: float) -> dict[str, float]:
        """Noise-free, anomaly-free values of every signal (ground truth for training)."""
        k = step_index(t_s)
        step = self._step(k)
        return {s: self._clean(s, k, step) for s in SIGNALS}

    def active_anomalies(self, t_s: float) -> list[Anomaly]:
        """The anomalies affecting the values at ``t_s``, in the order they were given."""
        k = step_index(t_s)
        return [a for a in self.anomalies if a._active_step(k)]

    # -- measurement layer -----------------------------------------------------------------

    def _measured(self, index: int, signal: str, k: int, clean: float) -> float:
        """Clean value + noise (scaled by active noise bursts) + drift and spike offsets."""
        multiplier = 1.0
        offset = 0.0
        for a in self._by_signal[signal]:
            if not a._active_step(k):
                continue
            if a.kind == "noise":
                multiplier *= a.magnitude
            elif a.kind == "drift":
                offset += a.magnitude * (k - a.start_step) / max(1, a.end_step - a.start_step)
            elif a.kind == "spike":
                offset += self._spike(index, a, k)
        value = clean + NOISE_STD[signal] * multiplier * _gauss(self._key, _S_NOISE + index, k)
        if signal in _NONNEGATIVE:
            value = max(0.0, value)
        return value + offset

    def _stuck_value(self, index: int, signal: str, k: int) -> float:
        cached = self._stuck_cache.get((signal, k))
        if cached is None:
            cached = self._measured(index, signal, k, self._clean(signal, k, self._step(k)))
            self._stuck_cache[(signal, k)] = cached
        return cached

    def _spike(self, index: int, a: Anomaly, k: int) -> float:
        rel = k - a.start_step
        slot, pos = divmod(rel, _SPIKE_SLOT_STEPS)
        # Keyed on the anomaly's own signal and start, not its list position, so adding an
        # unrelated anomaly never moves these spikes.
        counter = (a.start_step << 24) ^ slot
        stream = _S_SPIKE + index
        first = 0
        if slot:
            spread = _SPIKE_SLOT_STEPS - _SPIKE_STEPS
            first = math.floor(_uniform(self._key, stream, 2 * counter) * spread)
        if not first <= pos < first + _SPIKE_STEPS:
            return 0.0
        return a.magnitude * (0.6 + 0.4 * _uniform(self._key, stream, 2 * counter + 1))

    # -- physics ---------------------------------------------------------------------------

    def _clean(self, signal: str, k: int, step: _Step) -> float:
        if signal == "temperature":
            return self._temperature(k)
        return cast(float, getattr(step, signal))

    def _step(self, k: int) -> _Step:
        last = self._last_step
        if last is not None and last[0] == k:
            return last[1]
        frequency, setpoint, ramp, torque = self._drive(k)
        current = self._current(frequency, torque)
        speed = max(0.0, _RPM_PER_HZ * frequency - _RATED_SLIP_RPM * torque) if frequency else 0.0
        t = k * STEP_S
        voltage = (
            _V_NOMINAL
            + 3.0 * math.sin(2.0 * math.pi * t / 600.0 + self._voltage_phase)
            - 0.12 * current
        )
        r = speed / 1500.0
        vibration = (
            0.35 + 2.4 * r * r + 0.9 * math.exp(-(((speed - _RESONANCE_RPM) / 70.0) ** 2))
            if frequency
            else 0.05
        )
        step = _Step(frequency, setpoint, ramp, torque, current, speed, voltage, vibration)
        self._last_step = (k, step)
        return step

    def _drive(self, k: int) -> tuple[float, float, int, float]:
        """(output frequency, setpoint, ramp direction, torque) of step ``k``."""
        i = self._segment(k)
        setpoint = self._seg_setpoint[i]
        previous = self._seg_setpoint[i - 1] if i else 0.0
        elapsed = (k - self._seg_start[i]) * STEP_S
        delta = setpoint - previous
        ramp = 0
        frequency = setpoint
        if elapsed * _RAMP_HZ_PER_S < abs(delta):
            ramp = 1 if delta > 0 else -1
            frequency = previous + ramp * _RAMP_HZ_PER_S * elapsed
        if frequency <= 0.0:
            return 0.0, setpoint, ramp, 0.0
        load_prev = self._seg_load[i - 1] if i else self._seg_load[0]
        load = load_prev + (self._seg_load[i] - load_prev) * min(1.0, elapsed / _LOAD_SETTLE_S)
        load += 0.04 * math.sin(2.0 * math.pi * k * STEP_S / 13.7 + self._load_phase)
        ratio = frequency / _BASE_HZ
        torque = load * (0.3 + 0.7 * ratio * ratio) + ramp * _ACCEL_TORQUE_PU
        return frequency, setpoint, ramp, torque

    @staticmethod
    def _current(frequency: float, torque: float) -> float:
        if frequency <= 0.0:
            return 0.0
        magnetising = _I_MAG_A * min(1.0, frequency / 5.0)
        active = _I_TORQUE_RATED_A * torque
        return math.sqrt(magnetising * magnetising + active * active)

    def _segment(self, k: int) -> int:
        while self._seg_start[-1] <= k:
            self._draw_segment_body(len(self._seg_setpoint))
        return bisect.bisect_right(self._seg_start, k) - 1

    def _draw_segment_body(self, i: int) -> None:
        """Draw setpoint and load of segment ``i`` and the start of segment ``i + 1``."""
        previous = self._seg_setpoint[i - 1]
        if previous > 0.0 and _uniform(self._key, _S_STOP, i) < _STOP_PROBABILITY:
            setpoint = 0.0
        else:
            # Never repeat the previous setpoint: every segment boundary is a visible change.
            choices = [f for f in _SETPOINTS_HZ if f != previous]
            setpoint = choices[math.floor(_uniform(self._key, _S_SETPOINT, i) * len(choices))]
        duration = _SEGMENT_MIN_STEPS + math.floor(
            _uniform(self._key, _S_SEGMENT, i) * _SEGMENT_SPAN_STEPS
        )
        self._seg_setpoint.append(setpoint)
        self._seg_load.append(self._draw_load(i))
        self._seg_start.append(self._seg_start[i] + duration)

    def _draw_load(self, i: int) -> float:
        return 0.45 + 0.5 * _uniform(self._key, _S_LOAD, i)

    def _temperature(self, k: int) -> float:
        chunk, offset = divmod(k, _CHECKPOINT_STEPS)
        return self._chunk(chunk)[offset]

    def _chunk(self, c: int) -> list[float]:
        """Temperatures of the 100 steps of plant second ``c``."""
        cached = self._chunks.get(c)
        if cached is not None:
            self._chunks.move_to_end(c)
            return cached
        while len(self._checkpoints) <= c:
            last = len(self._checkpoints) - 1
            self._checkpoints.append(self._integrate(last)[1])
        temps, _ = self._integrate(c)
        self._chunks[c] = temps
        if len(self._chunks) > _CHUNK_CACHE:
            self._chunks.popitem(last=False)
        return temps

    def _integrate(self, c: int) -> tuple[list[float], float]:
        """Step second ``c`` from its checkpoint: its 100 temperatures and the next checkpoint.

        Checkpoints and chunks go through this one function, so a value reached either way
        is the same float.
        """
        temperature = self._checkpoints[c]
        temps: list[float] = []
        base = c * _CHECKPOINT_STEPS
        ambient = self.ambient_c
        for j in range(_CHECKPOINT_STEPS):
            temps.append(temperature)
            frequency, _, _, torque = self._drive(base + j)
            current = self._current(frequency, torque)
            steady = ambient + _R_THERMAL * current * current
            temperature = steady + (temperature - steady) * _THERMAL_DECAY
        return temps, temperature
