package qemu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"unicode"

	"github.com/dsec-dev/dsec/internal/fail"
)

// screendumpSeq names each screendump's file uniquely within a VM's
// directory, so that concurrent screenshots do not read each other's.
var screendumpSeq atomic.Uint64

// Screendump returns what the VM's display shows, as a PNG: QMP
// screendump with format png (QEMU 7.1 and later) into a file in the VM's
// directory, read back and removed. The VM needs a display device (a VGA
// in its Devices); QEMU's console is what the guest's display adapter
// scans out, whatever -display says.
func (vm *VM) Screendump(ctx context.Context) ([]byte, error) {
	path := filepath.Join(vm.dir, fmt.Sprintf("screen-%d.png", screendumpSeq.Add(1)))
	defer os.Remove(path)
	if _, err := vm.Run(ctx, "screendump", map[string]any{"filename": path, "format": "png"}); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: screendump: %w", err)
	}
	return b, nil
}

// InputEvent is one event of QMP input-send-event (an InputEvent union
// in QEMU's schema): a key, a button, or an absolute pointer axis.
type InputEvent struct {
	Type string         `json:"type"` // "key", "btn" or "abs"
	Data map[string]any `json:"data"`
}

// KeyEvent presses (down) or releases the key with QEMU's qcode name
// ("a", "ret", "shift", "ctrl", "f1", ...).
func KeyEvent(qcode string, down bool) InputEvent {
	return InputEvent{Type: "key", Data: map[string]any{
		"down": down, "key": map[string]any{"type": "qcode", "data": qcode},
	}}
}

// ButtonEvent presses or releases a pointer button ("left", "middle",
// "right", "wheel-up", "wheel-down").
func ButtonEvent(button string, down bool) InputEvent {
	return InputEvent{Type: "btn", Data: map[string]any{"down": down, "button": button}}
}

// AbsEvent moves the absolute pointer's axis ("x" or "y") to value, in
// QEMU's absolute range [0, AbsMax] (an absolute pointing device, a
// tablet, scales it to the screen).
func AbsEvent(axis string, value int) InputEvent {
	return InputEvent{Type: "abs", Data: map[string]any{"axis": axis, "value": value}}
}

// AbsMax is the largest absolute pointer coordinate QEMU takes.
const AbsMax = 0x7fff

// InputSendEvent sends events to the guest in order (QMP
// input-send-event, to the console's devices: the keyboard and the
// absolute pointer the VM has).
func (vm *VM) InputSendEvent(ctx context.Context, events []InputEvent) error {
	if len(events) == 0 {
		return nil
	}
	_, err := vm.Run(ctx, "input-send-event", map[string]any{"events": events})
	return err
}

// usKeys maps the printable ASCII characters a US keyboard types without
// shift to their qcodes; shifted lists those typed with shift, by the
// unshifted key's qcode.
var (
	usKeys = map[rune]string{
		' ': "spc", '\n': "ret", '\t': "tab",
		'-': "minus", '=': "equal", '[': "bracket_left", ']': "bracket_right",
		'\\': "backslash", ';': "semicolon", '\'': "apostrophe", '`': "grave_accent",
		',': "comma", '.': "dot", '/': "slash",
	}
	shifted = map[rune]string{
		'!': "1", '@': "2", '#': "3", '$': "4", '%': "5", '^': "6", '&': "7", '*': "8",
		'(': "9", ')': "0", '_': "minus", '+': "equal", '{': "bracket_left",
		'}': "bracket_right", '|': "backslash", ':': "semicolon", '"': "apostrophe",
		'~': "grave_accent", '<': "comma", '>': "dot", '?': "slash",
	}
)

// TextEvents turns text into key presses on a US layout, one press and
// release per character (shift held for capitals and symbols). A
// character no US key types is an InvalidArgument naming its position.
func TextEvents(text string) ([]InputEvent, error) {
	var ev []InputEvent
	for i, r := range text {
		code, shift := "", false
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			code = string(r)
		case r >= 'A' && r <= 'Z':
			code, shift = string(unicode.ToLower(r)), true
		default:
			if c, ok := usKeys[r]; ok {
				code = c
			} else if c, ok := shifted[r]; ok {
				code, shift = c, true
			}
		}
		if code == "" {
			return nil, fail.Errorf(fail.InvalidArgument, "text: character %q at byte %d has no key on a US keyboard", r, i)
		}
		if shift {
			ev = append(ev, KeyEvent("shift", true))
		}
		ev = append(ev, KeyEvent(code, true), KeyEvent(code, false))
		if shift {
			ev = append(ev, KeyEvent("shift", false))
		}
	}
	return ev, nil
}

// ChordEvents presses the keys of a chord ("ctrl-alt-delete", "shift-a",
// "ret") in order and releases them in reverse. Key names are QEMU's
// qcodes, lower case; a name QEMU does not know is refused by QEMU.
func ChordEvents(chord string) ([]InputEvent, error) {
	if chord == "" {
		return nil, fail.Errorf(fail.InvalidArgument, "key: empty")
	}
	// "minus" names the key; a bare "-" would split into nothing.
	keys := strings.Split(chord, "-")
	for i, k := range keys {
		if k == "" || strings.ToLower(k) != k || strings.ContainsFunc(k, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_')
		}) {
			return nil, fail.Errorf(fail.InvalidArgument, "key %q: part %d (%q) is not a QEMU key name (lower case letters, digits, _)", chord, i, k)
		}
	}
	var ev []InputEvent
	for _, k := range keys {
		ev = append(ev, KeyEvent(k, true))
	}
	for i := len(keys) - 1; i >= 0; i-- {
		ev = append(ev, KeyEvent(keys[i], false))
	}
	return ev, nil
}
