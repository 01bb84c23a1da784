package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// The screen, keyboard and mouse of a sandbox that has them (fullvm).

func newSandboxScreenshotCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "screenshot ID OUT.png",
		Short: "Save what a sandbox's screen shows as a PNG image (fullvm)",
		Args:  cli.ExactArgs(2, "ID OUT.png"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			png, w, h, err := c.Sandbox(args[0], dsec.Unnumbered()).Screenshot(cmd.Context())
			if err != nil {
				return err
			}
			if err := os.WriteFile(args[1], png, 0o644); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %dx%d, %d bytes\n", args[1], w, h, len(png))
			return nil
		},
	}
}

func newSandboxInputCmd(g *globals) *cobra.Command {
	var events []dsec.InputEvent
	cmd := &cobra.Command{
		Use:   "input ID (--text STR | --key KEY | --move X,Y | --click X,Y[,BUTTON])...",
		Short: "Send keyboard and mouse input to a sandbox's screen (fullvm)",
		Long: `Send keyboard and mouse input to a sandbox's screen. Each flag may repeat;
events are sent in the order the flags are given:
  --text STR          type STR, a key press per character
  --key KEY           press and release KEY, or a chord joined by "-"
                      (QEMU key names: ret, esc, tab, ctrl-alt-delete, shift-a)
  --move X,Y          move the pointer to X,Y (pixels from the top left)
  --click X,Y[,BTN]   move there and click BTN (left, middle or right; left)`,
		Args: cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(events) == 0 {
				return cli.Usagef("give at least one of --text, --key, --move or --click")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			return c.Sandbox(args[0], dsec.Unnumbered()).Input(cmd.Context(), events...)
		},
	}
	fl := cmd.Flags()
	for _, name := range []string{"text", "key", "move", "click"} {
		fl.Var(&inputFlag{name: name, events: &events}, name, map[string]string{
			"text": "type this text", "key": "press and release a key or chord",
			"move": "move the pointer to X,Y", "click": "click at X,Y[,BUTTON]"}[name])
	}
	return cmd
}

// inputFlag is one of input's flags: every use appends its event to one
// list shared by the four, so the events keep the command line's order.
type inputFlag struct {
	name   string
	events *[]dsec.InputEvent
}

func (f *inputFlag) String() string { return "" }
func (f *inputFlag) Type() string {
	if f.name == "move" || f.name == "click" {
		return "X,Y"
	}
	return "string"
}

func (f *inputFlag) Set(val string) error {
	ev, err := parseInput(f.name, val)
	if err != nil {
		return err
	}
	*f.events = append(*f.events, ev)
	return nil
}

// parseInput makes the event of flag --name val.
func parseInput(name, val string) (dsec.InputEvent, error) {
	switch name {
	case "text":
		return dsec.TypeText(val), nil
	case "key":
		return dsec.PressKey(val), nil
	}
	parts := strings.Split(val, ",")
	if len(parts) < 2 || len(parts) > 3 || (name == "move" && len(parts) != 2) {
		if name == "move" {
			return dsec.InputEvent{}, fmt.Errorf("want X,Y")
		}
		return dsec.InputEvent{}, fmt.Errorf("want X,Y or X,Y,BUTTON")
	}
	x, errX := strconv.Atoi(strings.TrimSpace(parts[0]))
	y, errY := strconv.Atoi(strings.TrimSpace(parts[1]))
	if errX != nil || errY != nil {
		return dsec.InputEvent{}, fmt.Errorf("X and Y are whole numbers of pixels")
	}
	if name == "move" {
		return dsec.MoveTo(x, y), nil
	}
	btn := ""
	if len(parts) == 3 {
		btn = strings.TrimSpace(parts[2])
	}
	return dsec.ClickAt(x, y, btn), nil
}
