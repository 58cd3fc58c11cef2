"""paraview.py: a ParaView session of a run that opens ready.

:func:`write_session` finds the field series in a run folder (``density_<prompt>``,
``velocity_<prompt>``, ``adjoint_<prompt>`` as .pvd or .bp, ``tokens_<prompt>.pvd``,
``heads.pvd``) and writes a pvpython script that opens them all, one render view per
prompt (and one for the heads), colours every series on a fixed range over depth (the
range over all frames, from fields.npz and the params files, written into the script;
ParaView's range over all time steps where the run did not record one), adds the depth
t (or the training step) and the prompt's name, and shows 1-D densities as curves, 2-D
ones as surfaces, 3-D ones on a slice, velocities as arrows and tokens as points::

    paraview --script=paraview.py                            # the GUI, ready
    pvpython paraview.py --screenshot out.png [--time T]     # one picture of all views
    xvfb-run -a -s "-screen 0 1280x1024x24" pvbatch paraview.py --screenshot out.png

The script reads its settings from one JSON literal (json.loads, no code generated from
data) and names the series relative to its own folder. It runs with ParaView 5.10 to
5.13 (the time annotation's format and a few enumeration names changed in between).
"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET

import numpy as np

from ..model import params as tree
from ..tools.errors import InputError
from ..tools.files import TEXT_FILE, read_bytes
from ..tools.output import atomic_write
from .run_files import read_npz, read_params, read_summary

SCRIPT_NAME = "paraview.py"
SERIES = re.compile(r"(density|velocity|adjoint|tokens)_(.+)\.(pvd|bp)")
ARRAYS = {"density": "density", "velocity": "velocity", "adjoint": "adjoint", "tokens": None}


def particle_colour(kind: str) -> str:
    """The point data a block's particles (``kind``: "heads") are coloured by."""
    tree.registered()
    return {tree.PARTICLES[b]: tree.COLOURS[b] for b in tree.PARTICLES}[kind]


def field_series(folder: str) -> dict:
    """{prompt: {kind: file name}} of the series in the folder (kind: density,
    velocity, adjoint, tokens), and "heads.pvd" under the key None where it is there."""
    out: dict = {}
    for name in sorted(os.listdir(folder)):
        m = SERIES.fullmatch(name)
        if m:
            out.setdefault(m[2], {})[m[1]] = name
    if os.path.isfile(os.path.join(folder, "heads.pvd")):
        out[None] = {"heads": "heads.pvd"}
    return out


def config_prompts(folder: str) -> list[str]:
    """The prompt names in the config's order, as summary.json has them ([] without it,
    or where it cannot be read)."""
    try:
        return [p["name"] for p in read_summary(os.path.join(folder, "summary.json"))["config"]["prompts"]]
    except (InputError, KeyError, TypeError):
        return []


def prompt_order(folder: str, prompts, names: list[str] | None = None) -> list:
    """The prompts in the config's order (``names``, else summary.json's), the others after them."""
    names = config_prompts(folder) if names is None else names
    known = [n for n in names if n in prompts]
    return known + sorted(p for p in prompts if p not in known and p is not None) + \
        ([None] if None in prompts else [])


def recorded_ranges(folder: str) -> dict:
    """{array: (low, high)} over all frames and prompts: density and velocity (|v|)
    from fields.npz; each block's colour array (the heads' norm_A = |K^T Q|) from the
    params files."""
    ranges: dict = {}

    def widen(name, low, high):
        if abs(low) < 1e-9 * abs(high):   # rounding about 0
            low = 0.0
        if np.isfinite(low) and np.isfinite(high):
            old = ranges.get(name, (low, high))
            ranges[name] = (float(min(old[0], low)), float(max(old[1], high)))

    path = os.path.join(folder, "fields.npz")
    if os.path.isfile(path):
        pattern = re.compile(r"(density|velocity)_range_\d+")
        for key, a in read_npz(path, pattern.fullmatch).items():   # the ranges alone
            widen(pattern.fullmatch(key)[1], a[0], a[1])
    for _, params in read_params(folder):
        for block, arrays in params.items():
            norms = tree.POINTS[block](arrays)[1][tree.COLOURS[block]]
            widen(tree.COLOURS[block], norms.min(), norms.max())
    return ranges


CHART_DIMENSION = {"circle": 2, "sphere": 3}   # the space a circle or sphere lies in


def run_chart(folder: str) -> str:
    """fields.npz's ``chart``: "circle", "sphere", or "" (a flat mesh, or no such file)."""
    try:
        return str(read_npz(os.path.join(folder, "fields.npz"), lambda n: n == "chart").get("chart", ""))
    except InputError:
        return ""


def run_dimension(folder: str) -> int:
    """d of the run: fields.npz's box (the space of its circle or sphere), else
    summary.json's mesh, else 2."""
    try:
        f = read_npz(os.path.join(folder, "fields.npz"), ("chart", "box").__contains__)
        chart = str(f.get("chart", ""))
        return CHART_DIMENSION[chart] if chart else int(f["box"].shape[1])
    except (InputError, KeyError, IndexError, TypeError):
        pass
    try:
        return int(read_summary(os.path.join(folder, "summary.json"))["mesh"]["dim"])
    except (InputError, KeyError, TypeError, ValueError):
        return 2


def series_times(path: str) -> list[float] | None:
    """[first, last] time of a .pvd series (depth t; the training step of heads.pvd);
    None for a .bp series (ADIOS2, not read here) or an empty one. InputError naming a
    .pvd that is not a regular file of at most TEXT_FILE bytes or not a collection."""
    if not path.endswith(".pvd"):
        return None
    text = read_bytes(path, "", TEXT_FILE)
    try:
        times = [float(ds.get("timestep")) for ds in ET.fromstring(text).iter("DataSet")]
    except (ET.ParseError, TypeError, ValueError) as e:
        raise InputError(f"{path}: not a ParaView collection (.pvd) ({type(e).__name__}: {e})") from None
    if not all(map(math.isfinite, times)):
        raise InputError(f"{path}: a timestep is not a finite number")
    return [min(times), max(times)] if times else None


def session(folder: str, data_dir: str = ".", names: list[str] | None = None) -> dict | None:
    """The settings of the script: views (one per prompt, in the order of ``names`` or
    of summary.json's config, one for the heads), each with its series (file relative to
    the script, kind, array, fixed range or None), the token dimension, and ``times``:
    {"t": [first, last] depth, "step": [first, last] training step} over the series (None
    where a series' times are unknown: the script's --time is checked against them);
    None where the folder has no series."""
    series = field_series(folder)
    if not series:
        return None
    ranges = recorded_ranges(folder)
    views = []
    times: dict | None = {}
    for prompt in prompt_order(folder, series, names):
        found = series[prompt]
        entries = []
        time = "step" if prompt is None else "t"
        for kind in ("density", "velocity", "adjoint", "tokens", "heads"):
            if kind in found:
                array = ARRAYS[kind] if kind in ARRAYS else particle_colour(kind)
                entries.append({"file": os.path.join(data_dir, found[kind]).replace(os.sep, "/"),
                                "kind": kind, "array": array,
                                "range": list(ranges[array]) if array in ranges else None})
                span = series_times(os.path.join(folder, found[kind]))
                if span is None or times is None:
                    times = None
                else:
                    old = times.get(time, span)
                    times[time] = [min(old[0], span[0]), max(old[1], span[1])]
        views.append({"name": prompt if prompt is not None else "heads", "series": entries, "time": time})
    return {"dim": run_dimension(folder), "chart": run_chart(folder), "views": views, "times": times or None}


def write_session(folder: str, out: str | None = None, names: list[str] | None = None) -> str | None:
    """Write paraview.py into ``out`` (default: the run folder) for the run in ``folder``
    (``names``: its prompts in the config's order, else summary.json's); its name, or
    None where the run wrote no field series."""
    out = out or folder
    settings = session(folder, os.path.relpath(folder, out), names)
    if settings is None:
        return None
    text = SCRIPT.replace("@SETTINGS@", json.dumps(settings, indent=1))
    with atomic_write(os.path.join(out, SCRIPT_NAME)) as f:
        f.write(text)
    return SCRIPT_NAME


SCRIPT = r'''"""The ParaView session of this pdeformer run (written by pdeformer: see docs/howto/paraview.md).

    paraview --script=paraview.py                            # the GUI, every series open
    pvpython paraview.py --screenshot out.png [--time T]     # all views at depth T (default: the last frame)
    xvfb-run -a -s "-screen 0 1280x1024x24" pvbatch paraview.py --screenshot out.png   # without a display

One view per prompt (and one for the heads of a training run); every series coloured on
its range over all frames (fixed when the run ended).

A bad --screenshot or --time ends the script before ParaView loads, with one line
"pdeformer: error: ..." and exit status 2; a screenshot ParaView did not write, with
exit status 3.
"""
import json
import math
import os
import sys

SETTINGS = json.loads(r"""
@SETTINGS@
""")
EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")   # what SaveScreenshot writes
TIMES = {"t": "depth t", "step": "training step"}


def fail(message, status=2):
    """One line on stderr and exit ``status`` (2: a bad argument, 3: output not written),
    by os._exit: once ParaView has rendered, pvbatch's shutdown after sys.exit crashes
    (X errors, SIGSEGV) and replaces the status."""
    sys.stdout.flush()
    sys.stderr.write("pdeformer: error: " + message + "\n")
    sys.stderr.flush()
    os._exit(status)


def options(argv, names=("--screenshot", "--time")):
    """{name: value} of the options ``names`` given (also as --name=value; the last one
    counts; None where the value is missing); other arguments are left alone (ParaView's)."""
    found = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in names:
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else None
                i += 1
            found[name] = value
        i += 1
    return found


def check_range(value, times):
    """Exit 2 where ``value`` lies outside the times ({name: [first, last]}): ParaView
    would show the nearest frame without a word."""
    low, high = min(r[0] for r in times.values()), max(r[1] for r in times.values())
    slack = 1e-9 * max(1.0, abs(low), abs(high))
    if not low - slack <= value <= high + slack:
        fail("--time: %g is outside the run's times (%s)" % (value, ", ".join(
            "%s: %g to %g" % (TIMES.get(k, k), r[0], r[1]) for k, r in times.items())))


def time_value(text, times):
    """--time as a finite number inside the run's times (``times``: SETTINGS' record of
    the series, None where it has none)."""
    expected = "--time: expected a number (a depth t or a training step), got "
    if text is None:
        fail(expected + "nothing")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        fail(expected + repr(text))
    if times:
        check_range(value, times)
    return value


def screenshot_file(text):
    """--screenshot as an absolute file name: an image type SaveScreenshot writes, in a
    folder that exists and takes a new file (tried by creating one)."""
    if text is None or not text.strip() or text.startswith("--"):   # "--...": the next option
        fail("--screenshot: expected an image file name (%s), got %s"
             % (", ".join(EXTENSIONS), "nothing" if text is None else repr(text)))
    path = os.path.abspath(text)
    folder = os.path.dirname(text) or os.curdir
    if os.path.isdir(path):
        fail("--screenshot: %s: is a folder, not a file name" % text)
    if os.path.splitext(path)[1].lower() not in EXTENSIONS:
        fail("--screenshot: %s: not an image file name (%s)" % (text, ", ".join(EXTENSIONS)))
    if not os.path.isdir(folder):
        fail("--screenshot: %s: %s" % (folder, "not a folder" if os.path.exists(folder) else
                                       "no such folder"))
    probe = os.path.join(os.path.dirname(path), ".pdeformer-probe.%d" % os.getpid())
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        fail("--screenshot: %s: cannot write into this folder (%s)" % (folder, e.strerror or e))
    return path


ARGUMENTS = options(sys.argv[1:] if getattr(sys, "argv", None) else [])
SCREENSHOT = screenshot_file(ARGUMENTS["--screenshot"]) if "--screenshot" in ARGUMENTS else None
TIME = time_value(ARGUMENTS["--time"], SETTINGS.get("times")) if "--time" in ARGUMENTS else None

# this file is named paraview.py: its own folder must not shadow ParaView's package
_FOLDER = os.path.dirname(os.path.abspath(globals().get("__file__") or os.path.join(os.getcwd(), "x")))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _FOLDER]
if not hasattr(sys.modules.get("paraview"), "__path__"):
    sys.modules.pop("paraview", None)
from paraview.simple import *  # noqa: E402,F401,F403


def here():
    """The folder of this script: the series are named relative to it."""
    path = globals().get("__file__") or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    return os.path.dirname(os.path.abspath(path)) if path else os.getcwd()


def paraview_version():
    v = GetParaViewVersion()
    return (v.major, v.minor)


def set_first(proxy, prop, values):
    """Set the first of ``values`` that this ParaView accepts (enumeration names changed)."""
    for value in values:
        try:
            setattr(proxy, prop, value)
            return
        except (ValueError, AttributeError, TypeError):
            pass


def open_series(path):
    """A reader of the series, updated (its bounds and ranges known)."""
    reader = ADIOS2VTXReader(FileName=path) if path.endswith(".bp") else PVDReader(FileName=path)
    reader.UpdatePipeline()
    return reader


BARS = {"density": ("Lower Left Corner", "Viridis (matplotlib)"),
        "velocity": ("Lower Right Corner", "Cool to Warm"),
        "adjoint": ("Lower Right Corner", "Cool to Warm"),
        "norm_A": ("Lower Right Corner", "Viridis (matplotlib)")}


def colour(display, view, array, value_range, component=None):
    """Colour ``display`` by ``array`` on a fixed range (the run's, or the data's over
    all times), with a small horizontal colour bar."""
    ColorBy(display, ("POINTS", array) if component is None else ("POINTS", array, component))
    lut = GetColorTransferFunction(array)
    corner, preset = BARS.get(array, ("Lower Right Corner", "Cool to Warm"))
    lut.ApplyPreset(preset, True)
    if value_range is not None and value_range[1] > value_range[0]:
        lut.AutomaticRescaleRangeMode = "Never"
        lut.RescaleTransferFunction(value_range[0], value_range[1])
        GetOpacityTransferFunction(array).RescaleTransferFunction(value_range[0], value_range[1])
    else:
        display.RescaleTransferFunctionToDataRangeOverTime()
        lut.AutomaticRescaleRangeMode = "Never"
    display.SetScalarBarVisibility(view, True)
    bar = GetScalarBar(lut, view)
    bar.Title, bar.ComponentTitle = ("speed" if array == "velocity" else array), ""
    bar.Orientation = "Horizontal"
    set_first(bar, "WindowLocation", [corner, corner.replace(" ", "")])
    bar.TitleFontSize = bar.LabelFontSize = 10
    bar.ScalarBarLength = 0.3
    bar.RangeLabelFormat = "%-#6.2g"


def label(view, text, corner):
    source = Text(Text=text)
    display = Show(source, view)
    display.FontSize = 11
    set_first(display, "WindowLocation", [corner, corner.replace(" ", "")])


def time_label(view, source, name):
    """The depth t (or training step) of the frame shown, in the upper right corner."""
    annotate = AnnotateTimeFilter(Input=source)
    digits = 0 if name == "step" else 3
    annotate.Format = (name + " = {time:.%df}" % digits) if paraview_version() >= (5, 11) \
        else (name + " = %%.%df" % digits)
    display = Show(annotate, view)
    display.FontSize = 11
    set_first(display, "WindowLocation", ["Upper Right Corner", "UpperRightCorner"])


def show_density(view, reader, entry, dim, chart=""):
    """1-D: the curve x -> (x, rho); 2-D: the surface; 3-D: the slice through the centre;
    a circle or sphere (``chart``) coloured by rho where it lies."""
    array, value_range = entry["array"], entry["range"]
    if chart:
        display = Show(reader, view)
        if chart == "circle":
            display.LineWidth = 4.0
    elif dim == 1:
        top = value_range[1] if value_range else reader.PointData[array].GetRange()[1]
        bounds = reader.GetDataInformation().GetBounds()
        warp = WarpByScalar(Input=reader)
        warp.Scalars = ["POINTS", array]
        warp.Normal = [0.0, 1.0, 0.0]
        warp.UseNormal = 1
        warp.ScaleFactor = 0.5 * (bounds[1] - bounds[0]) / top if top > 0 else 1.0
        display = Show(warp, view)
        display.LineWidth = 2.0
    elif dim == 2:
        display = Show(reader, view)
    else:
        outline = Show(reader, view)
        outline.SetRepresentationType("Outline")
        b = reader.GetDataInformation().GetBounds()
        cut = Slice(Input=reader)
        cut.SliceType = "Plane"
        cut.SliceType.Origin = [(b[0] + b[1]) / 2, (b[2] + b[3]) / 2, (b[4] + b[5]) / 2 + 1e-3 * (b[5] - b[4])]
        cut.SliceType.Normal = [0.0, 0.0, 1.0]
        display = Show(cut, view)
    colour(display, view, array, value_range)


def show_vectors(view, reader, entry, dim):
    """Arrows of one length, coloured by |v| (1-D: the series is opened, not shown)."""
    if dim == 1:
        return
    bounds = reader.GetDataInformation().GetBounds()
    size = max(bounds[1] - bounds[0], bounds[3] - bounds[2])
    arrows = Glyph(Input=reader, GlyphType="Arrow")
    arrows.OrientationArray = ["POINTS", entry["array"]]
    arrows.ScaleArray = ["POINTS", "No scale array"]
    arrows.ScaleFactor = 0.08 * size
    arrows.GlyphType.TipRadius, arrows.GlyphType.ShaftRadius = 0.2, 0.06
    set_first(arrows, "MaximumNumberOfSamplePoints", [150])
    if dim == 2:   # above the density's plane
        lifted = Transform(Input=arrows)
        lifted.Transform = "Transform"
        lifted.Transform.Translate = [0.0, 0.0, 0.02 * size]
        arrows = lifted
    colour(Show(arrows, view), view, entry["array"], entry["range"], "Magnitude")


def show_points(view, reader, entry):
    """Tokens (one colour) or heads (coloured by |A|) as points."""
    display = Show(reader, view)
    display.SetRepresentationType("Points")
    display.PointSize = 3.0 if entry["kind"] == "tokens" else 9.0
    set_first(display, "RenderPointsAsSpheres", [1])
    if entry["array"]:
        colour(display, view, entry["array"], entry["range"])
    else:
        ColorBy(display, None)
        display.AmbientColor = display.DiffuseColor = [0.85, 0.3, 0.1]


def build(settings):
    """One render view per entry of settings["views"], side by side."""
    folder = here()
    layout = CreateLayout("pdeformer")
    dim = settings["dim"]
    views = []
    for spec in settings["views"]:
        view = CreateView("RenderView")
        AssignViewToLayout(view=view, layout=layout, hint=0)
        view.OrientationAxesVisibility = 0
        first = None
        for entry in spec["series"]:
            reader = open_series(os.path.join(folder, entry["file"]))
            first = first or reader
            if entry["kind"] in ("density", "adjoint"):
                show_density(view, reader, entry, dim, settings.get("chart", ""))
            elif entry["kind"] == "velocity":
                show_vectors(view, reader, entry, dim)
            else:
                show_points(view, reader, entry)
        label(view, spec["name"], "Upper Left Corner")
        if first is not None:
            time_label(view, first, spec["time"])
        if spec["name"] == "heads":
            view.AxesGrid.Visibility = 1
            view.AxesGrid.XTitle, view.AxesGrid.YTitle, view.AxesGrid.ZTitle = "t (layer)", "tr V / d", "tr A / d"
        elif dim < 3:
            set_first(view, "InteractionMode", ["2D"])
        else:   # from above and aside
            view.CameraPosition, view.CameraFocalPoint, view.CameraViewUp = [3, -4, 5], [0, 0, 0], [0, 0, 1]
        view.ResetCamera()
        views.append(view)
    return layout, views


def show_time(views, value=None):
    """Every view at depth (or step) ``value``, checked against the series' times as
    ParaView read them (SETTINGS has none for .bp series); the last time step by default."""
    scene = GetAnimationScene()
    scene.UpdateAnimationUsingDataTimeSteps()
    steps = sorted(GetTimeKeeper().TimestepValues or [])
    if value is not None and steps:
        check_range(value, {"the series' times": [steps[0], steps[-1]]})
    t = value if value is not None else (steps[-1] if steps else 0.0)
    set_first(scene, "AnimationTime", [t])
    for view in views:
        view.ViewTime = t
        view.ResetCamera()
    return t


def save_screenshot(path, layout, resolution):
    """SaveScreenshot into a temporary file beside ``path``, renamed onto it: exit 3
    where ParaView wrote nothing (it reports that only in its log) or the rename fails."""
    extension = os.path.splitext(path)[1].lower()   # ParaView knows the lower-case names
    partial = os.path.join(os.path.dirname(path), ".pdeformer-screenshot.%d%s" % (os.getpid(), extension))
    problem = "ParaView wrote no screenshot"
    try:
        SaveScreenshot(partial, layout, ImageResolution=resolution)
        if os.path.isfile(partial) and os.path.getsize(partial) > 0:
            os.replace(partial, path)
            problem = None
    except OSError as e:
        problem = e.strerror or str(e)
    if os.path.lexists(partial):   # empty, or not renamed
        try:
            os.remove(partial)
        except OSError:
            pass
    if problem:
        fail("output: cannot write %s (%s)" % (path, problem), 3)


layout, views = build(SETTINGS)
show_time(views, TIME)
RenderAllViews()
if SCREENSHOT:
    save_screenshot(SCREENSHOT, layout, [460 * len(views), 420])
'''
