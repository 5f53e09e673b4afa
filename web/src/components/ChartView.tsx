/** A Chart.js canvas with an accessible name; the same numbers are always also in a table next to it. */
import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  Legend,
  LineController,
  LineElement,
  LinearScale,
  PointElement,
  Tooltip,
  type ChartConfiguration,
} from "chart.js";
import { useEffect, useRef } from "preact/hooks";

// Tree-shaken Chart.js: only what our bar/line charts use. Registering again is a no-op.
function register(): void {
  Chart.register(BarController, BarElement, LineController, LineElement, PointElement, CategoryScale, LinearScale, Tooltip, Legend);
}

/** Distinct colours that stay apart for the colour-blind (Okabe–Ito). */
export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"];

export function ChartView(props: { config: ChartConfiguration; label: string; testid: string; height?: number }) {
  const canvas = useRef<HTMLCanvasElement>(null);
  const chart = useRef<Chart | null>(null);

  useEffect(() => {
    register();
    // No 2D context (canvas blocked, or a DOM without canvas): the table beside the chart still has the numbers.
    if (!canvas.current || !canvas.current.getContext("2d")) return;
    chart.current = new Chart(canvas.current, {
      ...props.config,
      options: { animation: false, responsive: true, maintainAspectRatio: false, ...props.config.options },
    });
    return () => {
      chart.current?.destroy();
      chart.current = null;
    };
    // The chart is created once; data changes go through update() below.
  }, [props.config.type]);

  useEffect(() => {
    const c = chart.current;
    if (!c) return;
    c.data = props.config.data;
    c.options = { animation: false, responsive: true, maintainAspectRatio: false, ...props.config.options };
    c.update("none");
  }, [props.config]);

  return (
    <div class="chart" data-testid={props.testid} style={{ height: `${props.height ?? 260}px` }}>
      <canvas ref={canvas} role="img" aria-label={props.label} />
    </div>
  );
}
