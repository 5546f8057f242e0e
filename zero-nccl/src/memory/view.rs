//! Device memory of a model's gradients and parameters, in the model's
//! dtype: f32, or bf16/f16 for a 16-bit model whose engine keeps f32 master
//! weights and reduces gradients in f32.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::{bf16, f16};

/// A gradient or parameter on the GPU, read-only, in its own dtype.
#[derive(Clone, Copy)]
pub enum DeviceView<'a> {
    /// f32 elements.
    F32(&'a dyn DevicePtr<f32>),
    /// bf16 elements (widened to f32 as the engine reads them).
    Bf16(&'a dyn DevicePtr<bf16>),
    /// f16 elements (widened to f32 as the engine reads them).
    F16(&'a dyn DevicePtr<f16>),
}

impl DeviceView<'_> {
    /// Its length in elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(p) => p.len(),
            Self::Bf16(p) => p.len(),
            Self::F16(p) => p.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for DeviceView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = match self {
            Self::F32(_) => "f32",
            Self::Bf16(_) => "bf16",
            Self::F16(_) => "f16",
        };
        write!(f, "DeviceView({dtype}, {} elements)", self.len())
    }
}

/// A parameter on the GPU, writable, in its own dtype (16-bit values are
/// rounded to nearest even as the engine writes them).
pub enum DeviceViewMut<'a> {
    /// f32 elements.
    F32(&'a mut dyn DevicePtrMut<f32>),
    /// bf16 elements.
    Bf16(&'a mut dyn DevicePtrMut<bf16>),
    /// f16 elements.
    F16(&'a mut dyn DevicePtrMut<f16>),
}

impl DeviceViewMut<'_> {
    /// The same memory, lent again for a shorter while (to gather views of
    /// different lifetimes into one list).
    pub fn reborrow(&mut self) -> DeviceViewMut<'_> {
        match self {
            Self::F32(p) => DeviceViewMut::F32(&mut **p),
            Self::Bf16(p) => DeviceViewMut::Bf16(&mut **p),
            Self::F16(p) => DeviceViewMut::F16(&mut **p),
        }
    }

    /// Its length in elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(p) => p.len(),
            Self::Bf16(p) => p.len(),
            Self::F16(p) => p.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An element type a [`DeviceView`] holds.
pub trait ViewElement: cudarc::driver::DeviceRepr + 'static {
    /// `p` as a view.
    fn view(p: &dyn DevicePtr<Self>) -> DeviceView<'_>;
    /// `p` as a writable view.
    fn view_mut(p: &mut dyn DevicePtrMut<Self>) -> DeviceViewMut<'_>;
}

macro_rules! view_element {
    ($t:ty, $variant:ident) => {
        impl ViewElement for $t {
            fn view(p: &dyn DevicePtr<Self>) -> DeviceView<'_> {
                DeviceView::$variant(p)
            }
            fn view_mut(p: &mut dyn DevicePtrMut<Self>) -> DeviceViewMut<'_> {
                DeviceViewMut::$variant(p)
            }
        }

        impl<'a> From<&'a CudaSlice<$t>> for DeviceView<'a> {
            fn from(p: &'a CudaSlice<$t>) -> Self {
                DeviceView::$variant(p)
            }
        }

        impl<'a> From<&'a CudaView<'_, $t>> for DeviceView<'a> {
            fn from(p: &'a CudaView<'_, $t>) -> Self {
                DeviceView::$variant(p)
            }
        }

        impl<'a> From<&'a mut CudaSlice<$t>> for DeviceViewMut<'a> {
            fn from(p: &'a mut CudaSlice<$t>) -> Self {
                DeviceViewMut::$variant(p)
            }
        }

        impl<'a> From<&'a mut CudaViewMut<'_, $t>> for DeviceViewMut<'a> {
            fn from(p: &'a mut CudaViewMut<'_, $t>) -> Self {
                DeviceViewMut::$variant(p)
            }
        }
    };
}

view_element!(f32, F32);
view_element!(bf16, Bf16);
view_element!(f16, F16);
